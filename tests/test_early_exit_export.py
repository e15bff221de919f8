"""The torch.cond form of an early-exit model through torch.compile, torch.export, AOTInductor and
ExecuTorch (portable): every artifact must match the eager model on inputs that take each branch."""

from __future__ import annotations

import pytest
import torch

from torchcls.errors import UserError
from torchcls.models import SmallNet
from torchcls.models.early_exit import build_early_exit, confidence
from torchcls.models.early_exit_export import (CondEarlyExit, InputSpec, aoti_package, executorch_program,
                                               export_early_exit, inductor_safe, load_aoti, load_executorch,
                                               load_exported)

pytestmark = pytest.mark.slow
SPEC = InputSpec(channels=1, img_size=12, max_batch=4)


@pytest.fixture(scope="module")
def case():
    """A tiny early-exit model, and batches that leave at exit 0 ('early') or go deeper ('late')."""
    torch.manual_seed(0)
    model = build_early_exit("smallnet", SmallNet(3, 1, width=4), 3, 0, 0.5).eval()
    x = torch.randn(64, 1, 12, 12) * torch.linspace(0.2, 4, 64)[:, None, None, None]
    with torch.no_grad():
        conf = confidence(model.all_exits(x)[0])
    model.threshold = float(conf.median())
    order = conf.argsort()
    batches = {"early": x[order[-2:]], "late": x[order[:2]]}
    with torch.no_grad():
        eager = {k: model.dynamic(b) for k, b in batches.items()}
    assert set(eager["early"][1].tolist()) == {0} and 0 not in eager["late"][1].tolist()
    return model, batches, eager


def _same(eager, got, atol=1e-4):
    logits, index = eager
    assert torch.equal(got[0].argmax(1), logits.argmax(1))
    assert torch.equal(got[1].long(), index)
    assert torch.allclose(got[0], logits, atol=atol)


@pytest.fixture(scope="module")
def exported(case):
    return export_early_exit(case[0], SPEC)


def test_compile_fullgraph_matches_eager_on_both_branches(case):
    model, batches, eager = case
    with inductor_safe(), torch.no_grad():
        compiled = torch.compile(CondEarlyExit(model), fullgraph=True, dynamic=False)
        for branch, x in batches.items():
            _same(eager[branch], compiled(x))


def test_torch_export_matches_eager_and_refuses_other_shapes(case, exported):
    _, batches, eager = case
    ops = [str(n.target) for n in exported.graph.nodes]
    assert any("cond" in op for op in ops)  # the decision is in the graph
    run = load_exported(exported, SPEC)
    with torch.no_grad():
        for branch, x in batches.items():
            _same(eager[branch], run(x))
    for bad in (torch.randn(5, 1, 12, 12), torch.randn(2, 3, 12, 12), torch.randn(2, 1, 16, 16), torch.randn(1, 12, 12)):
        with pytest.raises(UserError, match="outside this early-exit artifact's declared shapes"):
            run(bad)
    with pytest.raises(Exception):  # the exported program itself also guards its static dims
        exported.module()(torch.randn(2, 1, 16, 16))


def test_aoti_package_matches_eager_on_both_branches(case, exported, tmp_path):
    _, batches, eager = case
    run = load_aoti(aoti_package(exported, tmp_path / "ee.pt2"), SPEC)
    with torch.no_grad():
        for branch, x in batches.items():
            _same(eager[branch], run(x))
    with pytest.raises(UserError, match="1 <= N <= 4"):
        run(torch.randn(8, 1, 12, 12))


def test_executorch_portable_matches_eager_on_both_branches(case, exported, tmp_path):
    pytest.importorskip("executorch")
    _, batches, eager = case
    run = load_executorch(executorch_program(exported, tmp_path / "ee.pte"), SPEC)
    for branch, x in batches.items():
        _same(eager[branch], run(x))
    with pytest.raises(UserError, match="declared shapes"):
        run(torch.randn(2, 1, 28, 28))

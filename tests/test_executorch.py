"""ExecuTorch export: real .pte programs lowered once per session and run by the ExecuTorch runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("executorch")

from torchcls.errors import UserError  # noqa: E402

INT8_MAX_DROP_PT = 10.0  # the stated bound for the tiny shapes model (20 held-out images: one image = 5 pt)


@pytest.fixture(scope="module")
def fp32_pte(trained_run: Path):
    from torchcls.artifacts import export

    return export(trained_run, target="executorch", parity_images=80)  # the default bound (--max-batch 64)


@pytest.fixture(scope="module")
def int8_pte(trained_run: Path):
    from torchcls.artifacts import export

    return export(trained_run, target="executorch", quantize="int8", calibration_images=48, parity_images=80)


def test_fp32_program_matches_eager_and_reports_delegation(fp32_pte, trained_run):
    from torchcls.artifacts import load_artifact
    from torchcls.artifacts.targets.executorch import ExecuTorchArtifact

    assert fp32_pte.path.suffix == ".pte" and fp32_pte.path.parent.name == "executorch-fp32"
    saved = json.loads(fp32_pte.parity_path.read_text())
    for key in ("max_abs_diff", "top1_agreement", "n"):
        assert key in saved
    assert saved["top1_agreement"] == 1.0 and saved["n"] == 20 and saved["max_abs_diff"] < 1e-4
    et = saved["executorch"]
    assert et["backend"] == "xnnpack" and et["delegated_subgraphs"] >= 1
    assert any("convolution" in op for op in et["delegated_ops"])
    assert et["program_bytes"] == fp32_pte.path.stat().st_size
    assert not [p for p in fp32_pte.path.parent.iterdir() if "partial" in p.name]
    art = load_artifact(fp32_pte.path)
    assert isinstance(art, ExecuTorchArtifact)
    assert art.info.classes == ["circle", "square"] and art.info.max_batch == 64


@pytest.mark.parametrize("which", ["fp32_pte", "int8_pte"])
def test_every_batch_size_up_to_the_default_bound_runs(which, request):
    """The runtime once planned the input for 15 images (a shape guard narrowed the batch range while
    lowering) and refused batch 16 and above: run one program at 1, 2, 17, 63 and 64 images."""
    from torchcls.artifacts import load_artifact

    result = request.getfixturevalue(which)
    art = load_artifact(result.path)
    assert art.info.max_batch == 64
    torch.manual_seed(0)
    full = torch.randn(64, 3, 32, 32)
    reference = art(full)
    for batch in (1, 2, 17, 63, 64):
        logits = art(full[:batch])
        assert logits.shape == (batch, 2)
        torch.testing.assert_close(logits, reference[:batch], atol=1e-4, rtol=1e-4)


def test_predict_through_runtime_equals_eager(fp32_pte, trained_run, capsys):
    from torchcls.checkpoint.files import load_model
    from torchcls.cli import main
    from torchcls.data import build_transform
    from torchcls.data.images import load_image

    images = sorted((trained_run.parent.parent / "shapes" / "circle").glob("*.png"))[:3]
    assert main(["predict", str(fp32_pte.path), *map(str, images), "--json"]) == 0
    preds = json.loads(capsys.readouterr().out)["predictions"]
    model, meta = load_model(trained_run)
    tf = build_transform(meta.preprocess, train=False)
    with torch.no_grad():
        probs = model(torch.stack([tf(load_image(f, 3)) for f in images])).softmax(1)
    for item, p in zip(preds, probs):
        top = item["top"][0]
        assert top["label"] == meta.classes[int(p.argmax())]
        assert abs(top["prob"] - float(p.max())) < 1e-4


def test_wrong_input_shape_is_a_user_error(fp32_pte):
    from torchcls.artifacts import load_artifact

    art = load_artifact(fp32_pte.path)
    with pytest.raises(UserError, match=r"shape \(N, 3, 32, 32\)"):
        art(torch.randn(1, 3, 16, 16))
    with pytest.raises(UserError, match="accepts 1 to 64"):
        art(torch.randn(65, 3, 32, 32))


def test_int8_accuracy_within_bound(int8_pte, fp32_pte):
    saved = json.loads(int8_pte.parity_path.read_text())
    assert int8_pte.path.parent.name == "executorch-int8" and saved["precision"] == "int8"
    assert saved["executorch"]["calibration_images"] == 48
    assert saved["accuracy_drop_pt"] <= INT8_MAX_DROP_PT
    assert saved["top1_agreement"] >= 0.9
    assert int8_pte.path.stat().st_size < fp32_pte.path.stat().st_size


def test_calibration_too_small_or_missing(trained_run, tmp_path):
    from torchcls.artifacts import export

    with pytest.raises(UserError, match="at least 16"):
        export(trained_run, target="executorch", quantize="int8", calibration_images=4, out=tmp_path)
    with pytest.raises(UserError, match="has only"):
        export(trained_run, target="executorch", quantize="int8", calibration_images=100_000, out=tmp_path)
    with pytest.raises(UserError, match="calibration"):
        export(trained_run, target="executorch", quantize="int8", data=str(tmp_path / "nowhere"), out=tmp_path)
    assert not list(tmp_path.iterdir())


@torch.library.custom_op("torchcls_test::odd", mutates_args=())
def _odd(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_odd.register_fake
def _(x):
    return torch.empty_like(x)


def test_unlowerable_op_is_named_and_nothing_written(trained_run, tmp_path, monkeypatch):
    import torchcls.artifacts.exporter as exporter
    from torchcls.artifacts import export

    real = exporter.load_model

    class WithOdd(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return _odd(self.inner(x))

    monkeypatch.setattr(exporter, "load_model", lambda p: (lambda m: (WithOdd(m[0]).eval(), m[1]))(real(p)))
    with pytest.raises(UserError, match=r"torchcls_test[.:]+odd.*--backend portable"):
        export(trained_run, target="executorch", max_batch=2, parity_images=4, out=tmp_path / "m.pte")
    assert not list(tmp_path.iterdir())


class CondNet(nn.Module):
    """An early-exit-style model: torch.cond picks a cheap or a deeper conv branch from the input."""

    def __init__(self):
        super().__init__()
        self.cheap = nn.Conv2d(3, 4, 3, padding=1)
        self.deep = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = torch.cond(x.mean() > 0, lambda t: self.cheap(t), lambda t: self.deep(t), (x,))
        return self.head(y.mean((2, 3)))


def test_cond_model_lowers_with_branches_on_portable(tmp_path):
    from executorch.runtime import Runtime

    from torchcls.artifacts.targets.executorch import lower

    torch.manual_seed(0)
    model = CondNet().eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    program, report = lower(ep, "xnnpack")
    assert any("convolution" in op for op in report.portable_ops)  # branch bodies
    assert any("portable" in n for n in report.notes)
    (tmp_path / "cond.pte").write_bytes(program)
    method = Runtime.get().load_program(str(tmp_path / "cond.pte")).load_method("forward")
    for inp in (x.abs() + 0.1, -x.abs() - 0.1):  # both branches
        (out,) = method.execute([inp])
        torch.testing.assert_close(out, model(inp).detach(), atol=1e-5, rtol=1e-4)

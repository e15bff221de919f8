"""The Checkpointer, single-process format: what it writes, what a resume restores, the lineage stamp.
(The sharded DCP format runs under torchrun in test_distributed.py.)"""

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from torchcls.checkpoint.checkpointer import Checkpointer, Progress
from torchcls.checkpoint.files import LINEAGE_KEY, CheckpointMeta, read_meta
from torchcls.data.loaders import Preprocess
from torchcls.errors import UserError
from torchcls.models import ModelSpec, create_model
from torchcls.training.optim import warmup_cosine

SRC = Path(__file__).resolve().parents[1] / "src" / "torchcls"
SPEC = ModelSpec("smallnet", 3, 1, 28)


def _objects(seed: int):
    torch.manual_seed(seed)
    model = create_model(SPEC)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, warmup_cosine(optimizer, 2, 10)


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(SPEC, ["a", "b", "c"], Preprocess(28, 1, (0.5,), (0.5,)), {"train": {"epochs": 1}}, 0, step)


def _steps(model, optimizer, scheduler, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(4, 1, 28, 28)).logsumexp(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def test_save_and_resume_restore_everything(tmp_path: Path):
    model, optimizer, scheduler = _objects(0)
    _steps(model, optimizer, scheduler, 3)
    ckpt = Checkpointer(tmp_path)
    assert not ckpt.has_state()
    ckpt.save(model, optimizer, scheduler, Progress(0, 3, 3, 0.5), _meta(3))
    rng = torch.get_rng_state()
    assert ckpt.has_state() and not ckpt.resumes_from_dcp()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.safetensors", "last.state.safetensors"]
    assert read_meta(ckpt.last_weights).step == 3

    fresh, fresh_opt, fresh_sched = _objects(1)
    torch.manual_seed(123)
    progress, resume_rng = Checkpointer(tmp_path).resume(fresh, fresh_opt, fresh_sched, _meta(0))
    assert progress == Progress(0, 3, 3, 0.5)
    assert torch.equal(resume_rng, rng)  # mid-epoch: the RNG to restore after replaying the epoch
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()
    for m, opt, sched in ((model, optimizer, scheduler), (fresh, fresh_opt, fresh_sched)):
        torch.manual_seed(5)
        _steps(m, opt, sched, 1)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)  # the optimizer moments came back too


def test_epoch_end_checkpoint_needs_no_rng(tmp_path: Path):
    model, optimizer, scheduler = _objects(0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(model, optimizer, scheduler, Progress(1, 4, 0, 0.25), _meta(4))
    progress, rng = ckpt.resume(*_objects(1), _meta(0))
    assert progress == Progress(1, 4, 0, 0.25) and rng is None  # the next epoch re-seeds itself


def test_lineage_is_stamped_when_weights_are_written(tmp_path: Path):
    model, optimizer, scheduler = _objects(0)
    lineage = {"run_id": "abc123", "audit_log": "/x/audit.jsonl", "outputs": {}}
    ckpt = Checkpointer(tmp_path, lineage=lineage)
    ckpt.save(model, optimizer, scheduler, Progress(), _meta(0))
    ckpt.save_best(model, _meta(0))
    for path in (ckpt.last_weights, ckpt.best_weights):
        with safe_open(str(path), framework="pt") as f:
            assert json.loads(f.metadata()[LINEAGE_KEY]) == lineage
    Checkpointer(tmp_path / "off").save_best(model, _meta(0))
    with safe_open(str(tmp_path / "off" / "best.safetensors"), framework="pt") as f:
        assert LINEAGE_KEY not in f.metadata()


def test_resume_without_state_is_a_user_error(tmp_path: Path):
    model, optimizer, scheduler = _objects(0)
    with pytest.raises(UserError, match="last.state.safetensors is missing"):
        Checkpointer(tmp_path).resume(model, optimizer, scheduler, _meta(0))


def test_each_checkpoint_file_name_is_written_out_once():
    """The training-state names live in checkpoint/files.py; everything else asks for them."""
    for name in ("last.state.safetensors", "last.state.pt", "last.dcp"):
        places = []
        for path in SRC.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value == name:
                    places.append(f"{path.relative_to(SRC)}:{node.lineno}")
        assert len(places) == 1 and places[0].startswith("checkpoint/files.py:"), (name, places)


def test_a_weight_wrapped_for_fp8_all_gather_is_saved_as_its_plain_tensor(tmp_path: Path):
    """torch 2.11 + torchao 0.17 (an H200's stack) handed FSDP2's full state dict out with torchao's wrapper
    around each FP8-all-gathered weight; safetensors cannot read a wrapper's storage."""
    pytest.importorskip("torchao")
    from safetensors.torch import load_file, save_file
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from torchcls.checkpoint.files import plain_state

    weight = torch.randn(16, 8)
    wrapped = WeightWithDynamicFloat8CastTensor(weight, LinearMMConfig(), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError):  # what the device check's FP8 FSDP2 run hit at its first save
        save_file({"w": wrapped}, tmp_path / "raw.safetensors")
    state = plain_state({"w": wrapped, "b": torch.ones(3)})
    assert type(state["w"]) is torch.Tensor and torch.equal(state["w"], weight)
    save_file(state, tmp_path / "plain.safetensors")
    assert torch.equal(load_file(tmp_path / "plain.safetensors")["w"], weight)

"""Distributed checkpoints from elsewhere are read without running code from them."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchcls.checkpoint.safe_dcp import safe_load
from torchcls.errors import UserError


def _save(path: Path) -> dict:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(24, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1, 5, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "progress": {"epoch": 3, "step": 17},
             "rng": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=str(path))  # no process group: one process writes it all
    return state


def test_a_real_checkpoint_loads_through_the_restricted_reader(tmp_path: Path) -> None:
    saved = _save(tmp_path / "ckpt")
    target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()},
              "progress": {"epoch": 0, "step": 0}, "rng": torch.zeros_like(saved["rng"])}
    safe_load(target, tmp_path / "ckpt")
    for k, v in saved["model"].items():
        torch.testing.assert_close(target["model"][k], v)
    assert target["progress"] == {"epoch": 3, "step": 17}
    assert torch.equal(target["rng"], saved["rng"])


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    saved = _save(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    with pytest.raises(UserError, match="refused to load its .metadata.*Nothing from it was run"):
        safe_load(target, tmp_path / "ckpt")
    assert not marker.exists()
    # torch's own reader would have run it: the reason this module exists.
    with pytest.raises(BaseException):  # noqa: PT011  (CheckpointException derives from BaseException)
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    assert marker.exists()

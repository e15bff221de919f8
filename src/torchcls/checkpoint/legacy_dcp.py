"""Sharded checkpoints in torch's pickle format (`.metadata` + `.distcp`), read only on request.

torchcls wrote these before its sharded checkpoints went pickle-free (checkpoint/hf_dcp.py). Their
index, `.metadata`, is a pickle: these functions run only under --unsafe-unpickle (dcp.load and
consolidate refuse such a dir before opening it otherwise), and even then through safe_dcp's
restricted unpickler, under its bounds. Their state kept progress, best top-1, learning rates,
plateau counters and epoch sums as tensors; `load_training_state` returns them in the shape
sharded_state.read gives for the new format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchcls.checkpoint.safe_dcp import SafeReader, safe_load
from torchcls.checkpoint.sharded_state import PLATEAU_KEYS


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's global shape from the checked `.metadata` (no tensor is read)."""
    saved = SafeReader(str(path)).read_metadata().state_dict_metadata
    return {k: tuple(m.size) for k, m in saved.items() if hasattr(m, "size")}


def load_training_state(path: Path, tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """Load the tensors of `tensors` in place from the old-format dir `path` and return the rest of its
    state as sharded_state.read does. `rest`: this run's own (its "other" leaves are kept: the old
    format saved none)."""
    saved = saved_shapes(path)
    state = dict(tensors, progress=torch.zeros(3, dtype=torch.int64), best_top1=torch.zeros((), dtype=torch.float64),
                 lr=torch.zeros(len(rest["lr"]), dtype=torch.float64))
    if "plateau" in saved:  # absent: written before the counters were saved
        state["plateau"] = torch.zeros(len(PLATEAU_KEYS), dtype=torch.float64)
    if "epoch_sums" in saved:  # as many rows as the saving world had ranks (bounded by the files' bytes)
        state["epoch_sums"] = torch.zeros(saved["epoch_sums"], dtype=torch.float64)
    safe_load(state, path)
    epoch, step, step_in_epoch = (int(v) for v in state["progress"])
    out = {"epoch": epoch, "step": step, "step_in_epoch": step_in_epoch, "best_top1": float(state["best_top1"]),
           "lr": state["lr"].tolist(), "other": rest["other"]}
    if "plateau" in state:
        out["plateau"] = {k: float(v) if k == "best" else int(v) for k, v in zip(PLATEAU_KEYS, state["plateau"].tolist())}
    if "epoch_sums" in state:
        out["epoch_sums"] = state["epoch_sums"].tolist()
    return out


def load_model_tensors(state: dict[str, Any], path: Path) -> None:
    """Load `state` ({"model": ...}) in place from the old-format dir `path` (one process)."""
    safe_load(state, path)

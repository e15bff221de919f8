"""The non-tensor half of a sharded checkpoint: state.json beside the safetensors shards.

The safetensors shards hold tensors only (checkpoint/hf_dcp.py). Everything else a resume needs is
plain numbers: where training stands (epoch, optimizer step, step in the epoch, best top-1), the
learning rates the schedule reached, the plateau schedule's counters, every rank's running sums of
the epoch, and whatever non-tensor leaves the optimizer's or the EMA's state holds. Rank 0 writes
them as one JSON object, atomically, when it commits the checkpoint; a resume reads it under
STATE_BOUNDS and checks every field's type and range before anything is set from it.
Floats go through JSON exactly (Python writes the shortest repr that reads back to the same double).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from torchcls.bounded_json import JsonBounds, read_bounded
from torchcls.errors import UserError

STATE = "state.json"
FORMAT = "torchcls-sharded-state/1"
MAX_RANKS = 65_536  # rows of epoch sums: one per rank of the saving world
MAX_COUNTER = 10**15  # epochs and steps
# 4 MiB: the epoch sums of MAX_RANKS ranks (4 numbers each, ~100 bytes a row) and a few thousand
# learning rates; nesting: the object, its "other" tree (optimizer state: state / fqn / name), a list.
STATE_BOUNDS = JsonBounds(max_bytes=8 * 2**20, max_values=6 * MAX_RANKS + 200_000, max_depth=8, max_str=4096,
                          allow_nonfinite=True)  # a best of -inf (plateau), sums of a diverged epoch
PLATEAU_KEYS = ("best", "num_bad_epochs", "cooldown_counter", "last_epoch")
_SCALARS = (bool, int, float, str, type(None))


def split(tree: dict[str, Any], where: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tensors of `tree`, its other leaves) as two trees of the same nesting. A leaf that is neither
    a tensor nor JSON (a number, string, None, or a list of those) is a programming error: TypeError."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            tensors[key], sub = split(value, f"{where}{key}.")
            if sub:
                plain[str(key)] = sub
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, _SCALARS) or (isinstance(value, (list, tuple))
                                            and all(isinstance(v, _SCALARS) for v in value)):
            plain[str(key)] = list(value) if isinstance(value, tuple) else value
        else:
            raise TypeError(f"{where}{key}: a {type(value).__name__} cannot be saved in a sharded checkpoint")
    return tensors, plain


def restore(target: dict[str, Any], saved: Any, where: str) -> dict[str, Any]:
    """`target`'s non-tensor leaves (the shape this run expects) with the values of `saved` (read from
    the file): every leaf must be there, of the same JSON kind."""
    if type(saved) is not dict:
        raise UserError(f"{where}: expected an object of saved values: damaged or from another model")
    out: dict[str, Any] = {}
    for key, expected in target.items():
        if key not in saved:
            raise UserError(f"{where}: no saved value for {key!r}: the checkpoint is from another model or optimizer")
        value = saved[key]
        if isinstance(expected, dict):
            out[key] = restore(expected, value, f"{where}.{key}")
        elif _kind(value) != _kind(expected):
            raise UserError(f"{where}.{key}: a {type(value).__name__} where this run has a {type(expected).__name__}")
        else:
            out[key] = value
    return out


def _kind(v: Any) -> str:
    return "number" if type(v) in (int, float) else type(v).__name__


def merge(tensors: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The tree `split` took apart, put back together."""
    out = dict(tensors)
    for key, value in plain.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def number(value: Any, name: str, where: str, lo: float = float("-inf"), hi: float = float("inf"),
           integer: bool = False, nan: bool = False) -> Any:
    ok = type(value) is int or (type(value) is float and not integer)
    if not ok or not (lo <= value <= hi or (nan and value != value)):
        raise UserError(f"{where}: {name} must be {'an integer' if integer else 'a number'} in [{lo}, {hi}], "
                        f"not {str(value)[:40]}: damaged or crafted")
    return value


def numbers(value: Any, name: str, where: str, length: int | None = None, nan: bool = False) -> list[float]:
    if type(value) is not list or (length is not None and len(value) != length):
        raise UserError(f"{where}: {name} must be a list of {length if length is not None else 'some'} numbers")
    return [float(number(v, name, where, nan=nan)) for v in value]


def read(path: Path) -> dict[str, Any]:
    """state.json of the checkpoint dir `path`, with its fixed fields checked (the "other" tree is
    checked against what this run expects by `restore`)."""
    where = str(path / STATE)
    raw = read_bounded(path / STATE, STATE_BOUNDS, what="sharded checkpoint state")
    if type(raw) is not dict or raw.get("format") != FORMAT:
        raise UserError(f"{where}: not a torchcls sharded checkpoint state ({FORMAT})")
    out = {k: number(raw.get(k), k, where, 0, MAX_COUNTER, integer=True) for k in ("epoch", "step", "step_in_epoch")}
    out["best_top1"] = float(number(raw.get("best_top1"), "best_top1", where))
    out["lr"] = numbers(raw.get("lr"), "lr", where)
    out["other"] = raw.get("other", {})
    if "plateau" in raw:
        plateau = raw["plateau"]
        if type(plateau) is not dict or set(plateau) != set(PLATEAU_KEYS):
            raise UserError(f"{where}: plateau must hold {', '.join(PLATEAU_KEYS)}")
        out["plateau"] = {k: number(plateau[k], k, where, integer=k != "best") for k in PLATEAU_KEYS}
    if "epoch_sums" in raw:
        rows = raw["epoch_sums"]
        if type(rows) is not list or not 0 < len(rows) <= MAX_RANKS:
            raise UserError(f"{where}: epoch_sums must be 1 to {MAX_RANKS} rows, one per rank")
        out["epoch_sums"] = [numbers(r, "an epoch_sums row", where, length=4, nan=True) for r in rows]
    return out


def dumps(state: dict[str, Any]) -> str:
    """The text of state.json for `state` (epoch, step, step_in_epoch, best_top1, lr, other, and
    plateau / epoch_sums when the run has them)."""
    return json.dumps({"format": FORMAT, **state})

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


def progress(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Where training stands, as both state formats hold it (state.json here; last.state.safetensors, state_file.py):
    epoch, step and step in the epoch integers in [0, MAX_COUNTER], and the best top-1 a number."""
    out = {k: number(raw.get(k), k, where, 0, MAX_COUNTER, integer=True) for k in ("epoch", "step", "step_in_epoch")}
    out["best_top1"] = float(number(raw.get("best_top1"), "best_top1", where))
    return out


def rng_state(value: Any, where: str) -> torch.Tensor:
    """A saved CPU generator state, as torch.set_rng_state takes it: a uint8 tensor of this torch's size."""
    size = torch.get_rng_state().numel()
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or tuple(value.shape) != (size,):
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserError(f"{where}: rng must be a uint8 tensor of {size} bytes (torch.get_rng_state()), not {got}: "
                        "damaged or crafted")
    return value


def like(saved: Any, expected: Any, where: str) -> None:
    """`saved` (read from a file) has the shape of `expected`, this run's own state of the same part: dicts of the
    same keys, lists of the same length, tensors of the same dtype and shape, other leaves of the same JSON kind.
    What a part's load_state_dict then sets from it can only be of the types the run itself would have set."""
    if isinstance(expected, dict):
        if type(saved) is not dict or set(saved) != set(expected):
            raise UserError(f"{where}: holds {_keys(saved, expected)} where this run has {_keys(expected, saved)}: "
                            "damaged, or from another model, optimizer or torch")
        for key, value in expected.items():
            like(saved[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        if type(saved) not in (list, tuple) or len(saved) != len(expected):
            raise UserError(f"{where}: a list of {len(expected)} was expected: damaged or from another setup")
        for i, (s, e) in enumerate(zip(saved, expected)):
            like(s, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or (saved.dtype, saved.shape) != (expected.dtype, expected.shape):
            raise UserError(f"{where}: a {expected.dtype} tensor of shape {tuple(expected.shape)} was expected: "
                            "damaged or from another model")
    elif _kind(saved) != _kind(expected):
        raise UserError(f"{where}: a {type(saved).__name__} where this run has a {type(expected).__name__}: damaged "
                        "or crafted")


def _keys(value: Any, other: Any) -> str:
    """The keys of `value` (a dict) that `other` has not, else what `value` is."""
    if not isinstance(value, dict):
        return f"a {type(value).__name__}"
    only = set(value) - (set(other) if isinstance(other, dict) else set())
    return f"keys {sorted(map(str, only))[:8]}" if only else "fewer keys"


def read(path: Path) -> dict[str, Any]:
    """state.json of the checkpoint dir `path`, with its fixed fields checked (the "other" tree is
    checked against what this run expects by `restore`)."""
    where = str(path / STATE)
    raw = read_bounded(path / STATE, STATE_BOUNDS, what="sharded checkpoint state")
    if type(raw) is not dict or raw.get("format") != FORMAT:
        raise UserError(f"{where}: not a torchcls sharded checkpoint state ({FORMAT})")
    out = progress(raw, where)
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

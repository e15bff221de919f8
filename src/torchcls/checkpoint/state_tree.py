"""A nested training state (dicts, lists, tuples, scalars, tensors) as JSON plus named tensors: no pickle.

The optimizer's, scheduler's and grad scaler's state dicts are trees of Python values with tensors
at some leaves; torch.save pickles them, and reading a pickle means trusting the unpickler. Here
`flatten` turns a tree into a JSON value that names its tensors ("t0", "t1", ...), the tensors
going into a safetensors file beside it, and `unflatten` rebuilds the tree. Every JSON object of the
encoding is a one-key tag, so nothing in a tree can be mistaken for one:

  None, bool, str, list, finite float, int of 64 bits   as themselves
  {"dict": [[key, value], ...]}   a dict of any hashable keys (an optimizer's state is keyed by int)
  {"tuple": [...]}   {"float": "nan" | "inf" | "-inf"}   {"int": "<digits>"} (beyond 64 bits)
  {"tensor": "t3"}   the tensor stored under that name

Reading, the JSON is bounded before it is parsed (bounded_json.py, STATE_BOUNDS), and
anything that is not one of these forms is a UserError: a file can give back values, never objects.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from torchcls.bounded_json import JsonBounds
from torchcls.errors import UserError

# A training state's JSON: a few thousand parameter ids and hyperparameters (kilobytes for ResNet-50's
# optimizer); 8 MiB is the bound on a whole safetensors header (safetensors_bounds.py) it is stored in.
STATE_BOUNDS = JsonBounds(max_bytes=8 * 2**20, max_values=2_000_000, max_depth=32, max_str=4096)
_BIG = 2**63
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_TAGS = ("dict", "tuple", "float", "int", "tensor")
_DIGITS = re.compile(r"-?[0-9]{1,64}")


def flatten(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """`tree` as a JSON value and the tensors it names (CPU, contiguous, no two sharing storage)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def encode(value: Any) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value if -_BIG <= value < _BIG else {"int": str(value)}
        if isinstance(value, float):
            return value if math.isfinite(value) else {"float": "nan" if math.isnan(value) else
                                                               ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = _storable(value, storages)
            return {"tensor": name}
        if isinstance(value, list):
            return [encode(v) for v in value]
        if isinstance(value, tuple):
            return {"tuple": [encode(v) for v in value]}
        if isinstance(value, dict):
            return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
        raise TypeError(f"cannot store a {type(value).__name__} in a training state: only dicts, lists, tuples, "
                        "None, bools, ints, floats, strings and tensors")

    return encode(tree), tensors


def _storable(t: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """A plain CPU tensor safetensors can write: a copy when it is on another device, not contiguous, or
    shares its storage with a tensor already taken (safetensors refuses aliases)."""
    t = t.detach()
    if type(t) is not torch.Tensor:
        raise TypeError(f"cannot store a {type(t).__name__} in a single-process training state")
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    elif t.untyped_storage().data_ptr() in storages:
        t = t.clone()
    if t.numel():
        storages.add(t.untyped_storage().data_ptr())
    return t


def unflatten(encoded: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The tree `flatten` encoded (`encoded` already within STATE_BOUNDS: its depth is bounded)."""
    if encoded is None or isinstance(encoded, (bool, str, int, float)):
        return encoded
    if isinstance(encoded, list):
        return [unflatten(v, tensors, where) for v in encoded]
    if not isinstance(encoded, dict) or len(encoded) != 1 or next(iter(encoded)) not in _TAGS:
        raise UserError(f"{where}: the training state holds a JSON object that is none of {', '.join(_TAGS)}: "
                        "the file is damaged or was not written by torchcls")
    (tag, body), = encoded.items()
    return _DECODERS[tag](body, tensors, where)


def _dict(body: Any, tensors: dict[str, torch.Tensor], where: str) -> dict:
    if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
        raise UserError(f"{where}: a dict in the training state must be a list of [key, value] pairs")
    out = {}
    for key, value in body:
        key = unflatten(key, tensors, where)
        if isinstance(key, (list, dict, torch.Tensor)) or (isinstance(key, tuple) and not _hashable(key)):
            raise UserError(f"{where}: a dict key in the training state must be a scalar or a tuple of scalars")
        out[key] = unflatten(value, tensors, where)
    return out


def _hashable(key: tuple) -> bool:
    return all(k is None or isinstance(k, (bool, int, float, str)) or (isinstance(k, tuple) and _hashable(k))
               for k in key)


def _tuple(body: Any, tensors: dict[str, torch.Tensor], where: str) -> tuple:
    if not isinstance(body, list):
        raise UserError(f"{where}: a tuple in the training state must be a JSON list")
    return tuple(unflatten(v, tensors, where) for v in body)


def _float(body: Any, tensors: dict[str, torch.Tensor], where: str) -> float:
    if not isinstance(body, str) or body not in _NONFINITE:
        raise UserError(f"{where}: a tagged float in the training state must be nan, inf or -inf")
    return _NONFINITE[body]


def _int(body: Any, tensors: dict[str, torch.Tensor], where: str) -> int:
    if not isinstance(body, str) or not _DIGITS.fullmatch(body):
        raise UserError(f"{where}: a tagged int in the training state must be at most 64 digits")
    return int(body)


def _tensor(body: Any, tensors: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    if not isinstance(body, str) or body not in tensors:
        raise UserError(f"{where}: the training state names a tensor {str(body)[:40]!r} that the file does not hold")
    return tensors[body]


_DECODERS = {"dict": _dict, "tuple": _tuple, "float": _float, "int": _int, "tensor": _tensor}

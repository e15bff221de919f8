"""The sharded format's tensors: DCP's HuggingFaceStorageWriter/Reader, with no pickle anywhere.

Each rank writes one safetensors file (`shard-0000R-model-00001-of-00001.safetensors`) holding its
shards; where each shard sits in the whole tensor (DCP's `saved_offsets`) is JSON in the file's
`__metadata__` (DCP_SHARDING_INFO). No `.metadata` is written: HuggingFaceStorageReader builds
DCP's metadata from the safetensors headers, so loading reshards to any world size, as before.

That reader trusts the headers: it reads every `*.safetensors` entry of the directory, and turns
each dtype, shape and offset into DCP's sizes and chunks as written. `check_dir` reads them first
under `SafetensorsBounds` (checkpoint/safetensors_bounds.py) and checks what DCP will build from
them: each tensor's offsets as long as its shape, its chunks of one dtype and rank, at distinct
offsets, their elements adding up to the whole tensor's (a chunk missing would leave part of a
tensor unloaded), the whole tensor's size bounded. Only then does the reader see the directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchcls.checkpoint.bounded_json import JsonBounds, load_bounded
from torchcls.checkpoint.safetensors_bounds import (
    DEFAULT_BOUNDS,
    METADATA,
    SafetensorsBounds,
    bounded_numel,
    check_safetensors_header,
    is_dim_list,
)
from torchcls.errors import UserError

SHARD_SUFFIX = ".safetensors"  # what HuggingFaceStorageReader reads: every entry of the dir with this suffix
SHARDING_KEY = "DCP_SHARDING_INFO"  # the __metadata__ key DCP's safetensors writer puts the offsets under
OFFSETS_KEY = "saved_offsets"
MAX_SHARDS = 4096  # files of one checkpoint: one per rank that holds tensors
MAX_DIR_ENTRIES = 4 * MAX_SHARDS  # entries of the dir listed before giving up (shards, meta.json, state.json)
MAX_CHUNKS = 1_000_000  # shard entries over all files (~150 bytes each while checked)


@dataclass
class SavedTensor:
    """What DCP's reader will make of one tensor: its dtype name, and its chunks (offsets, shape)."""
    dtype: str
    ndim: int
    chunks: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)

    @property
    def size(self) -> tuple[int, ...]:
        return tuple(max(o[i] + s[i] for o, s in self.chunks.items()) for i in range(self.ndim)) if self.chunks else ()


def writer(path: Path):
    """The storage writer of a sharded save into `path` (every rank writes its own shards)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    return HuggingFaceStorageWriter(str(path), save_distributed=True)


def check_tensors_only(state: dict[str, Any], where: str = "") -> None:
    """The safetensors writer stores tensors; anything else DCP would write as torch.save bytes (a pickle)
    in front of the file's header. The non-tensor state goes to JSON (checkpoint/dcp.py) instead."""
    for key, value in state.items():
        if isinstance(value, dict):
            check_tensors_only(value, f"{where}{key}.")
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}{key}: a {type(value).__name__} in the tensor part of a sharded checkpoint")


def storable(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` with each tensor safetensors can store: a wrapper tensor subclass holding one tensor (torchao's
    weight that FSDP2 all-gathers in FP8) has no storage of its own, so it is replaced by the tensor it
    wraps (inside a DTensor, the local shard is). The tensors share storage with the originals, so a load
    into them is a load into the model."""
    from torch.distributed.tensor import DTensor

    def plain(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = t.detach().to_local()
            inner = _unwrapped(local)
            return t if inner is local else DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False,
                                                                shape=t.shape, stride=t.stride())
        return _unwrapped(t)

    return {k: storable(v) if isinstance(v, dict) else plain(v) if isinstance(v, torch.Tensor) else v
            for k, v in tree.items()}


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # as files.plain_state

    while is_traceable_wrapper_subclass(t) and len(inner := t.__tensor_flatten__()[0]) == 1:
        t = getattr(t, inner[0])
    return t


def shard_files(path: Path) -> list[Path]:
    """The files HuggingFaceStorageReader would read from `path`, listed under a bound."""
    found = []
    try:
        with os.scandir(path) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_DIR_ENTRIES:
                    raise UserError(f"{path}: more than {MAX_DIR_ENTRIES} entries: not a torchcls checkpoint dir")
                if entry.name.endswith(SHARD_SUFFIX):
                    found.append(Path(entry.path))
    except OSError as e:
        raise UserError(f"cannot list the checkpoint dir {path}: {e.strerror}") from None
    if not found or len(found) > MAX_SHARDS:
        raise UserError(f"{path}: {len(found)} *{SHARD_SUFFIX} shard files (between 1 and {MAX_SHARDS} expected): "
                        "not a complete sharded checkpoint")
    return sorted(found)


def _sharding(header: dict[str, Any], shard: Path, bounds: SafetensorsBounds) -> dict[str, list[int]]:
    """The offsets DCP wrote for each tensor of `shard`, checked against its header's shapes."""
    text = header.get(METADATA, {}).get(SHARDING_KEY)
    if text is None:
        raise UserError(f"{shard}: its header has no {SHARDING_KEY}: not a shard written by a torchcls run")
    names = [k for k in header if k != METADATA]
    info = load_bounded(text, JsonBounds(max_bytes=bounds.max_header_bytes, max_values=len(names) * (
        3 + bounds.max_ndim) + 1, max_depth=3, max_str=bounds.max_name), f"{shard}: {SHARDING_KEY}")
    if type(info) is not dict or set(info) != set(names):
        raise UserError(f"{shard}: {SHARDING_KEY} does not list exactly the file's tensors: refused")
    offsets = {}
    for name in names:
        entry, shape = info[name], header[name]["shape"]
        ok = type(entry) is dict and set(entry) == {OFFSETS_KEY}
        if not (ok and is_dim_list(entry[OFFSETS_KEY], len(shape), bounds.max_dim) and len(entry[OFFSETS_KEY]) ==
                len(shape) and all(o + s <= bounds.max_dim for o, s in zip(entry[OFFSETS_KEY], shape))):
            raise UserError(f"{shard}: {SHARDING_KEY} of tensor {name[:80]!r} is not {len(shape)} offsets in "
                            f"[0, {bounds.max_dim}] for its shape {shape}: refused")
        offsets[name] = entry[OFFSETS_KEY]
    return offsets


def check_dir(path: Path, bounds: SafetensorsBounds = DEFAULT_BOUNDS) -> dict[str, SavedTensor]:
    """Every shard of the checkpoint dir `path` checked (see the module's doc); returns its tensors."""
    tensors: dict[str, SavedTensor] = {}
    chunks = 0
    for shard in shard_files(path):
        header = check_safetensors_header(shard, bounds)  # a link, FIFO or device is refused here
        for name, offsets in _sharding(header, shard, bounds).items():
            dtype, shape = header[name]["dtype"], tuple(header[name]["shape"])
            saved = tensors.setdefault(name, SavedTensor(dtype, len(shape)))
            if (saved.dtype, saved.ndim) != (dtype, len(shape)) or tuple(offsets) in saved.chunks:
                raise UserError(f"{shard}: tensor {name[:80]!r} ({dtype}, {len(shape)} dims at {offsets}) "
                                f"contradicts another shard of it ({saved.dtype}, {saved.ndim} dims): refused")
            saved.chunks[tuple(offsets)] = shape
            chunks += 1
            if chunks > MAX_CHUNKS:
                raise UserError(f"{path}: more than {MAX_CHUNKS} tensor shards: refused")
    for name, saved in tensors.items():
        _check_cover(name, saved, path, bounds)
    return tensors


def _check_cover(name: str, saved: SavedTensor, path: Path, bounds: SafetensorsBounds) -> None:
    whole = bounded_numel(list(saved.size), bounds.max_numel)
    parts = sum(bounded_numel(list(s), bounds.max_numel) or 0 for s in saved.chunks.values())
    if whole is None or parts != whole:
        raise UserError(f"{path}: tensor {name[:80]!r} of size {list(saved.size)} is not covered exactly by its "
                        f"{len(saved.chunks)} shard(s) ({parts} elements): a shard file is missing or crafted")


def load(state: dict[str, Any], path: Path, bounds: SafetensorsBounds = DEFAULT_BOUNDS) -> dict[str, SavedTensor]:
    """dcp.load the tensors of `state` (in place, any world size) from the checked dir `path`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException

    saved = check_dir(path, bounds)
    check_tensors_only(state)
    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
    except (Exception, CheckpointException) as e:  # a missing or mis-shaped tensor: DCP's own exceptions
        raise UserError(f"cannot load the sharded checkpoint {path} into this model: {str(e)[:400]}") from None
    return saved

"""The sharded format's tensors: DCP's HuggingFaceStorageWriter/Reader, with no pickle anywhere.

Each rank writes one safetensors file (`shard-0000R-model-00001-of-00001.safetensors`) holding its
shards; where each shard sits in the whole tensor (DCP's `saved_offsets`) is JSON in the file's
`__metadata__` (DCP_SHARDING_INFO). No `.metadata` is written: HuggingFaceStorageReader builds
DCP's metadata from the safetensors headers, so loading reshards to any world size, as before.

That reader trusts the headers: it reads every `*.safetensors` entry of the directory, and turns
each dtype, shape and offset into DCP's sizes and chunks as written. `check_dir` reads them first
under `SafetensorsBounds` (checkpoint/safetensors_bounds.py) and checks what DCP will build from
them: each tensor's offsets as long as its shape, its chunks of one dtype and rank, at distinct
offsets, tiling the whole tensor exactly: no two overlapping, none missing (either would leave part of
a tensor unloaded; `check_cover`), the whole tensor's size bounded. Only then does the reader see the
directory.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchcls.bounded_json import JsonBounds, load_bounded
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
MAX_CELLS_PER_CHUNK = 4  # grid cells per chunk when checking the tiling (what DCP writes: 1)


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

    from torchcls.checkpoint.subclass import inner_tensor

    def plain(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = t.detach().to_local()
            inner = inner_tensor(local)
            return t if inner is local else DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False,
                                                                shape=t.shape, stride=t.stride())
        return inner_tensor(t)

    return {k: storable(v) if isinstance(v, dict) else plain(v) if isinstance(v, torch.Tensor) else v
            for k, v in tree.items()}


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
        check_cover(name, saved, path, bounds)
    return tensors


def check_cover(name: str, saved: SavedTensor, path: Path, bounds: SafetensorsBounds) -> None:
    """The chunks tile the tensor exactly: every element in exactly one chunk. DCP's reader copies each
    chunk where its offsets say and never checks, so an overlap would hide a gap (chunks [0:2], [1:3],
    [4:5] of 5 elements add up to 5 and leave index 3 as it was before the load).

    Per dimension, the chunk edges (offsets and offset + length) cut the tensor into a grid; each chunk
    is a box of whole grid cells, and the chunks tile the tensor when every cell is in exactly one of them.
    For what DCP writes (a product of per-dimension splits: rows for FSDP2, a grid for 2-D meshes) the
    grid has as many cells as there are chunks; a layout whose grid has more than MAX_CELLS_PER_CHUNK
    times as many (a crafted staircase: n chunks, n**2 cells) is refused before the cells are counted."""
    size = saved.size
    whole = bounded_numel(list(size), bounds.max_numel)
    if whole is None:
        raise UserError(f"{path}: tensor {name[:80]!r} of size {list(size)} has more than {bounds.max_numel} "
                        "elements: refused")
    boxes = [(o, s) for o, s in saved.chunks.items() if all(s)]  # an empty chunk covers nothing
    cuts = [sorted({0, size[d]} | {o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d in range(saved.ndim)]
    cells = bounded_numel([len(c) - 1 for c in cuts], MAX_CELLS_PER_CHUNK * max(1, len(boxes)))
    if cells is None:
        raise UserError(f"{path}: tensor {name[:80]!r}: its {len(boxes)} shard(s) cut it into more than "
                        f"{MAX_CELLS_PER_CHUNK} grid cells per shard, not a layout DCP writes: refused")
    covered = _mark_cells(boxes, cuts, cells, name, path)
    if whole and covered != cells:
        raise UserError(f"{path}: tensor {name[:80]!r} of size {list(size)} is not covered exactly by its "
                        f"{len(saved.chunks)} shard(s) (a part of it is in none): a shard file is missing or crafted")


def _mark_cells(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], cuts: list[list[int]], cells: int,
                name: str, path: Path) -> int:
    """Mark the grid cells of each box (refusing a cell marked twice); returns how many were marked."""
    index = [{c: i for i, c in enumerate(cut)} for cut in cuts]
    strides = [1] * len(cuts)
    for d in range(len(cuts) - 2, -1, -1):
        strides[d] = strides[d + 1] * (len(cuts[d + 1]) - 1)
    seen, marked = bytearray(cells), 0
    for offsets, shape in boxes:
        ranges = [range(index[d][o], index[d][o + s]) for d, (o, s) in enumerate(zip(offsets, shape))]
        for cell in itertools.product(*ranges):
            flat = sum(i * st for i, st in zip(cell, strides))
            if seen[flat]:
                raise UserError(f"{path}: tensor {name[:80]!r}: its shard at offsets {list(offsets)} (shape "
                                f"{list(shape)}) overlaps another shard: not covered exactly (a crafted shard "
                                "would leave part of the tensor unloaded)")
            seen[flat], marked = 1, marked + 1
    return marked


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

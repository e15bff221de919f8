"""What an old-format DCP `.metadata` may hold: the bounds, and the check of what was unpickled.

Read only under --unsafe-unpickle (checkpoint/legacy_dcp.py). safe_dcp's unpickler builds objects of
DCP's metadata types only, under the unpickling bounds below; `check_layout` then walks the result
as a schema, iteratively: each field of the expected type, each container within its bound, every
rank and dimension bounded before any product is taken (a product of a thousand dims of 2**62 is
quadratic in their digits: the 17 s file of issue 30), every entry naming a file of the checkpoint
dir itself and a byte range inside it that no other entry claims, and every tensor tiled exactly by
its chunks (hf_dcp.check_cover: none repeated or overlapping) and stored in as many bytes as its size
needs. A tensor's size is then bounded by the checkpoint files' bytes.
Nothing unexpected can be nested anywhere in what DCP is then handed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchcls.checkpoint.hf_dcp import SavedTensor, check_cover
from torchcls.checkpoint.safetensors_bounds import SafetensorsBounds, bounded_numel
from torchcls.errors import UserError

# Unpickling (checked while the pickle is read, before the object they bound exists).
MAX_METADATA_BYTES = 64 * 2**20  # the .metadata file: ~100 bytes per tensor shard; 64 MiB is ~600k shards
MAX_STACK = 4096  # objects on the unpickler's stack (the pickler batches 1000 items per APPENDS/SETITEMS)
MAX_MARKS = 64  # open MARKs: containers being built inside each other
MAX_TUPLE = 64  # items of one tuple (torch.Size arguments, planner paths)
MAX_TUPLE_DEPTH = 4  # tuples in tuples: hashing a tuple recurses in C, with no limit (the SIGSEGV)
MAX_ENTRIES = 1_000_000  # items of one list or dict
MAX_SAME_HASH = 8  # dict keys of one hash value: more is a collision attack (each insert compares them all)
MAX_INT_BYTES = 8  # LONG1/LONG4 integers: DCP metadata holds offsets and lengths, nothing wider
# The object (checked once unpickled, before DCP sees it).
MAX_NDIM = 16  # dims of a tensor
MAX_DIM = 2**48  # one dimension or offset
MAX_NUMEL = 2**48  # elements of one tensor or chunk
MAX_NAME = 4096  # characters of a tensor name or file name
_COVER_BOUNDS = SafetensorsBounds(max_dim=MAX_DIM, max_numel=MAX_NUMEL)  # check_cover reads max_numel


def is_shape(value: Any) -> bool:
    """A torch.Size of at most MAX_NDIM dims, each in [0, MAX_DIM]: checked before any product of it."""
    return (type(value) is torch.Size and len(value) <= MAX_NDIM
            and all(type(d) is int and 0 <= d <= MAX_DIM for d in value))


def is_index(key: Any) -> bool:
    """A MetadataIndex as DCP writes it: a name, a shape-like offset or none, an int index or none."""
    return (type(key) is MetadataIndex and type(key.fqn) is str and len(key.fqn) <= MAX_NAME
            and (key.offset is None or is_shape(key.offset)) and (key.index is None or type(key.index) is int))


def _refuse(where: str, what: str) -> UserError:
    return UserError(f"{where}: {what}: refused (damaged, or not written by torch.distributed.checkpoint)")


def check_layout(md: Any, root: Path) -> None:
    """Refuse metadata that is not exactly DCP's types within the bounds, or whose entries point outside
    the checkpoint dir or past its files' ends, before anything is opened: torch's FileSystemReader joins
    `root / relative_path` as written, so an absolute path or `../` would read any file of the machine."""
    where = f"{root}/.metadata"
    if type(md) is not Metadata or type(md.storage_data) is not dict or type(md.state_dict_metadata) is not dict:
        raise _refuse(where, "not DCP metadata (no table of entries)")
    if len(md.storage_data) > MAX_ENTRIES or len(md.state_dict_metadata) > MAX_ENTRIES:
        raise _refuse(where, f"more than {MAX_ENTRIES} entries")
    _check_extras(md, where)
    sizes: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    for index, info in md.storage_data.items():
        if not is_index(index) or type(info) is not _StorageInfo:
            raise _refuse(where, "an entry of its storage table is not DCP metadata")
        _check_entry(index.fqn, info, root, sizes, where)
        spans.setdefault(info.relative_path, []).append((info.offset, info.length))
    _check_spans(spans, where)
    for fqn, entry in md.state_dict_metadata.items():
        if type(fqn) is str and type(entry) is BytesStorageMetadata and MetadataIndex(fqn) in md.storage_data:
            continue
        if type(fqn) is not str or type(entry) is not TensorStorageMetadata:
            raise _refuse(where, f"entry {str(fqn)[:80]!r} is not a stored tensor or byte entry")
        _check_tensor(fqn, entry, md.storage_data, where)


def _check_extras(md: Metadata, where: str) -> None:
    """The fields DCP's loader does not use for reading, held to their types all the same."""
    planner = md.planner_data
    if planner is not None and not (type(planner) is dict and all(
            type(k) is str and type(v) is tuple and all(type(p) in (str, int) for p in v) for k, v in planner.items())):
        raise _refuse(where, "its planner data is not a table of paths")
    meta = md.storage_meta
    if meta is not None and not (type(meta) is StorageMeta and type(meta.modules) is list
                                 and all(type(m) is str for m in meta.modules)
                                 and all(v is None or type(v) is str for v in (meta.save_id, meta.load_id))
                                 and (meta.checkpoint_id is None or isinstance(meta.checkpoint_id, (str, PurePath)))):
        raise _refuse(where, "its storage description is not DCP's")
    if getattr(md, "version", None) is not None and type(md.version) is not str:
        raise _refuse(where, "its version is not a string")


def _check_entry(fqn: str, info: _StorageInfo, root: Path, sizes: dict[str, int], where: str) -> None:
    name = info.relative_path
    if type(name) is not str or name in ("", ".", "..") or "/" in name or "\0" in name or len(name) > MAX_NAME:
        raise UserError(f"{where}: entry {fqn[:80]!r} is stored in {str(name)[:200]!r}, which is not the name of a "
                        "file in the checkpoint dir (a path elsewhere or above it): refused before anything was read")
    if name not in sizes:
        try:
            st = os.lstat(root / name)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise UserError(f"{where}: entry {fqn[:80]!r} is stored in {name[:200]!r}, which is not a regular file in "
                            f"{root} (missing, a link or a device): refused before anything was read")
        sizes[name] = st.st_size
    offset, length = info.offset, info.length
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > sizes[name]:
        raise UserError(f"{where}: entry {fqn[:80]!r} claims bytes {str(offset)[:30]}+{str(length)[:30]} of "
                        f"{name[:200]!r}, which holds {sizes[name]}: the checkpoint is damaged or crafted; refused")
    if info.transform_descriptors:  # compression and the like: a few bytes could expand without bound
        raise UserError(f"{where}: entry {fqn[:80]!r} is stored through transforms "
                        f"({repr(info.transform_descriptors)[:80]}), which torchcls never writes: refused")


def _check_tensor(fqn: str, entry: TensorStorageMetadata, storage: dict, where: str) -> None:
    props, size, chunks = entry.properties, entry.size, entry.chunks
    if (type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype) or not is_shape(size)
            or type(chunks) is not list or len(chunks) > MAX_ENTRIES):
        raise UserError(f"{where}: tensor {fqn[:80]!r} has a malformed description (or more than {MAX_NDIM} dims, "
                        f"or a dim over {MAX_DIM}): refused")
    total = bounded_numel(list(size), MAX_NUMEL)
    if total is None:
        raise UserError(f"{where}: tensor {fqn[:80]!r} has more than {MAX_NUMEL} elements: refused")
    tiles: dict[tuple[int, ...], tuple[int, ...]] = {}
    for chunk in chunks:
        if (type(chunk) is not ChunkStorageMetadata or not is_shape(chunk.offsets) or not is_shape(chunk.sizes)
                or not len(chunk.offsets) == len(chunk.sizes) == len(size)
                or any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, size))):
            raise UserError(f"{where}: tensor {fqn[:80]!r} has a chunk outside its size {list(size)}: refused")
        if tuple(chunk.offsets) in tiles:  # one stored chunk listed again would count its elements again
            raise UserError(f"{where}: tensor {fqn[:80]!r} lists its chunk at {list(chunk.offsets)} more than once: "
                            "refused (damaged or crafted)")
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        numel = bounded_numel(list(chunk.sizes), total)  # inside the tensor: at most its elements
        need = (numel or 0) * props.dtype.itemsize
        if info is None or need > info.length:
            raise UserError(f"{where}: tensor {fqn[:80]!r}: a chunk of {list(chunk.sizes)} {props.dtype} needs {need} "
                            "bytes, more than stored for it: refused (damaged or crafted)")
        tiles[tuple(chunk.offsets)] = tuple(chunk.sizes)
    if not total:
        return
    saved = SavedTensor(str(props.dtype), len(size), tiles)
    if saved.size != tuple(size):
        raise UserError(f"{where}: tensor {fqn[:80]!r} of size {list(size)} is not covered by its stored chunks: "
                        "refused")
    # The sharded format's exact-tiling check: overlapping chunks are refused, so the elements covered
    # (and allocated from this size by legacy_dcp) are elements stored.
    check_cover(fqn, saved, Path(where), _COVER_BOUNDS)


def _check_spans(spans: dict[str, list[tuple[int, int]]], where: str) -> None:
    """No two entries share bytes of a file: each chunk is backed by bytes of its own, so what the
    metadata says is stored is bounded by the files' sizes (DCP writes each item after the last)."""
    for name, ranges in spans.items():
        end = 0
        for offset, length in sorted(ranges):
            if offset < end:
                raise UserError(f"{where}: two entries claim the same bytes of {name[:200]!r} (at {offset}): "
                                "refused (damaged or crafted)")
            end = offset + length

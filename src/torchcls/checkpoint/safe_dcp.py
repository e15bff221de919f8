"""Loading a distributed (DCP) checkpoint without unpickling anything but its own data types.

torch's FileSystemReader.read_metadata is a plain `pickle.load` of `.metadata`, and the default
load planner reads non-tensor entries with `torch.load(weights_only=False)`: a run dir from
someone else could run code on `--resume` or `torchcls consolidate`. Here the metadata goes
through a pure-Python unpickler that resolves only an explicit list of (module, name) pairs and
builds state only into instances of DCP's own dataclasses (as torch's weights_only unpickler does),
then the result is checked before any shard is opened: every entry must name a file of the
checkpoint dir itself and a byte range inside it. Byte entries go through torch.load(weights_only=True).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import os
import pickle
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
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

from torchcls.errors import UserError

_DCP_TYPES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
              "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
# Every global a DCP .metadata may name, as exact (module, name) pairs. A name is looked up as one
# attribute, never as a dotted path: protocol 4 lets a pickle ask for `Metadata.__init__.__class__`
# (the function type), and from the function and code types it can build and call anything. Each
# entry below is a data type or a pure lookup: calling it with any arguments runs no code of the file's.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _DCP_TYPES}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
       ("torch", "Size"),
       ("torch.serialization", "_get_layout"),  # turns a layout's name back into torch.strided etc.
       ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
    | {("torch", name) for name, value in vars(torch).items()
       if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))})
_RESOLVED = [getattr(importlib.import_module(m), n) for m, n in sorted(ALLOWED_GLOBALS)]
_CALLABLE_IDS = frozenset(id(g) for g in _RESOLVED if callable(g))
_CLASS_IDS = frozenset(id(g) for g in _RESOLVED if isinstance(g, type))
# BUILD sets state, and pickle's BUILD does it on whatever lies on the stack: on a class or a function
# (`_get_layout` itself) it would rewrite process-wide attributes (`_get_layout.cache`, which every later
# torch.load consults). State goes only into an instance of one of these, and only into its own fields.
_BUILDABLE: dict[type, frozenset[str]] = {
    t: frozenset(f.name for f in dataclasses.fields(t))
    for t in (Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata,
              ChunkStorageMetadata, _StorageInfo)}


def _target(obj: Any, kinds: tuple[type, ...], op: str) -> Any:
    if type(obj) not in kinds:
        raise pickle.UnpicklingError(f"{op} on a {type(obj).__name__}: DCP metadata does that only on "
                                     f"{' or '.join(k.__name__ for k in kinds)}")
    return obj


class _MetadataUnpickler(pickle._Unpickler):
    """Resolves only ALLOWED_GLOBALS (anything else is refused before an object of it exists), calls only
    them, and builds, appends and sets items only into the types DCP metadata holds."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")

    def _callable(self, func: Any, op: str) -> Any:
        if id(func) not in _CALLABLE_IDS:
            raise pickle.UnpicklingError(f"{op} of {type(func).__name__}: only DCP metadata types are called")
        return func

    def _class(self, cls: Any, op: str) -> Any:
        if id(cls) not in _CLASS_IDS:
            raise pickle.UnpicklingError(f"{op} of {type(cls).__name__}: only DCP metadata types are created")
        return cls

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._callable(self.stack[-1], "REDUCE")(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self._class(self.stack.pop(), "NEWOBJ")
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        cls = self._class(self.stack.pop(), "NEWOBJ_EX")
        self.append(cls.__new__(cls, *args, **kwargs))

    def _instantiate(self, klass: Any, args: list) -> None:
        self.append(self._class(klass, "OBJ")(*args))

    def load_build(self) -> None:
        state, inst = self.stack.pop(), self.stack[-1]
        if type(inst) is TensorProperties:  # its own __setstate__ takes a plain tuple of its fields
            inst.__setstate__(_target(state, (tuple,), "BUILD state"))
            return
        fields = _BUILDABLE.get(type(inst))
        if fields is None:
            raise pickle.UnpicklingError(f"BUILD on a {type(inst).__name__}: state goes only into DCP metadata "
                                         "instances, never into a class, function or module")
        unknown = [k for k in _target(state, (dict,), "BUILD state") if k not in fields]
        if unknown:
            raise pickle.UnpicklingError(f"BUILD of {type(inst).__name__} with {unknown[0]!r}, not one of its fields")
        inst.__dict__.update(state)

    def load_append(self) -> None:
        value = self.stack.pop()
        _target(self.stack[-1], (list,), "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        _target(self.stack[-1], (list,), "APPENDS").extend(items)

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        _target(self.stack[-1], (dict, OrderedDict), "SETITEM")[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = _target(self.stack[-1], (dict, OrderedDict), "SETITEMS")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        _target(self.stack[-1], (set,), "ADDITEMS").update(items)


_MetadataUnpickler.dispatch.update({op[0]: getattr(_MetadataUnpickler, f"load_{op_name}") for op, op_name in (
    (pickle.REDUCE, "reduce"), (pickle.NEWOBJ, "newobj"), (pickle.NEWOBJ_EX, "newobj_ex"), (pickle.BUILD, "build"),
    (pickle.APPEND, "append"), (pickle.APPENDS, "appends"), (pickle.SETITEM, "setitem"),
    (pickle.SETITEMS, "setitems"), (pickle.ADDITEMS, "additems"))})


def check_layout(md: Metadata, root: Path) -> None:
    """Refuse metadata whose entries point outside the checkpoint dir or past its files' ends, before
    anything is opened: torch's FileSystemReader joins `root / relative_path` as written, so an absolute
    path or `../` would read any file of the machine into a consolidated output. Each tensor must be
    stored in as many bytes as its described size needs, so no size written in the metadata makes a
    loader allocate more than the checkpoint's files hold."""
    where = f"{root}/.metadata"
    if type(md.storage_data) is not dict or type(md.state_dict_metadata) is not dict:
        raise UserError(f"{where}: not DCP metadata (no table of entries): refused")
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo or type(index.fqn) is not str:
            raise UserError(f"{where}: an entry of its storage table is not DCP metadata: refused")
        _check_entry(index.fqn, info, root, sizes, where)
    for fqn, entry in md.state_dict_metadata.items():
        if type(fqn) is str and type(entry) is BytesStorageMetadata and MetadataIndex(fqn) in md.storage_data:
            continue
        if type(fqn) is not str or type(entry) is not TensorStorageMetadata:
            raise UserError(f"{where}: entry {str(fqn)[:80]!r} is not a stored tensor or byte entry: refused")
        _check_tensor(fqn, entry, md.storage_data, where)


def _check_entry(fqn: str, info: _StorageInfo, root: Path, sizes: dict[str, int], where: str) -> None:
    name = info.relative_path
    if type(name) is not str or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise UserError(f"{where}: entry {fqn[:80]!r} is stored in {str(name)[:200]!r}, which is not the name of a "
                        "file in the checkpoint dir (a path elsewhere or above it): refused before anything was read")
    if name not in sizes:
        try:
            st = os.lstat(root / name)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise UserError(f"{where}: entry {fqn[:80]!r} is stored in {name[:200]!r}, which is not a regular file in {root} "
                            "(missing, a link or a device): refused before anything was read")
        sizes[name] = st.st_size
    offset, length = info.offset, info.length
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > sizes[name]:
        raise UserError(f"{where}: entry {fqn[:80]!r} claims bytes {str(offset)[:30]}+{str(length)[:30]} of {name[:200]!r}, "
                        f"which holds {sizes[name]}: the checkpoint is damaged or crafted; refused")
    if info.transform_descriptors:  # compression and the like: a few bytes could expand without bound
        raise UserError(f"{where}: entry {fqn[:80]!r} is stored through transforms ({repr(info.transform_descriptors)[:80]}),"
                        " which torchcls never writes: refused")


def _shown(e: Exception) -> str:
    return repr(str(e)[:200])[1:-1]  # the text comes from the file: no control characters reach the terminal


def _is_shape(size: Any) -> bool:
    return type(size) is torch.Size and all(d >= 0 for d in size)


def _check_tensor(fqn: str, entry: TensorStorageMetadata, storage: dict, where: str) -> None:
    props, size, chunks = entry.properties, entry.size, entry.chunks
    if (type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype) or not _is_shape(size)
            or type(chunks) is not list):
        raise UserError(f"{where}: tensor {fqn[:80]!r} has a malformed description: refused")
    covered = 0
    for chunk in chunks:
        if (type(chunk) is not ChunkStorageMetadata or not _is_shape(chunk.offsets) or not _is_shape(chunk.sizes)
                or not len(chunk.offsets) == len(chunk.sizes) == len(size)
                or any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, size))):
            raise UserError(f"{where}: tensor {fqn[:80]!r} has a chunk outside its size {list(size)}: refused")
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        need = math.prod(chunk.sizes) * props.dtype.itemsize
        if info is None or need > info.length:
            raise UserError(f"{where}: tensor {fqn[:80]!r}: a chunk of {list(chunk.sizes)} {props.dtype} needs {need} "
                            f"bytes, more than stored for it: refused (damaged or crafted)")
        covered += math.prod(chunk.sizes)
    if covered < math.prod(size):
        raise UserError(f"{where}: tensor {fqn[:80]!r} of size {list(size)} is not covered by its stored chunks: refused")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:  # noqa: BLE001 - whatever a crafted file makes an allowed type raise
                raise UserError(f"{self.path}: refused to load its .metadata ({type(e).__name__}: {_shown(e)}); "
                                "a distributed checkpoint holds only DCP metadata types, so this one is damaged or "
                                "was not written by torch.distributed.checkpoint. Nothing from it was run") from None
        if not isinstance(metadata, Metadata):
            raise UserError(f"{path} is not DCP metadata ({type(metadata).__name__})")
        check_layout(metadata, Path(str(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserError(f"a distributed checkpoint entry ({read_item.dest_index.fqn}) needs unpickling "
                            f"beyond plain data: refused ({str(e).splitlines()[0][:160]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict[str, Any], path: str | Path) -> None:
    """dcp.load into `state` in place, through the restricted reader and planner."""
    from torch.distributed.checkpoint.api import CheckpointException

    SafeReader(str(path)).read_metadata()  # here first: DCP would fold our message into its own exception
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    except CheckpointException as e:
        refused = [err for err in e.failures.values() if isinstance(err, UserError)]
        if refused:
            raise refused[0] from None
        raise

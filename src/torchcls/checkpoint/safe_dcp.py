"""Reading a distributed (DCP) checkpoint in torch's old pickle format without running code from it.

Only under --unsafe-unpickle (checkpoint/legacy_dcp.py): torchcls writes sharded checkpoints
pickle-free now (checkpoint/hf_dcp.py). torch's FileSystemReader.read_metadata is a plain
`pickle.load` of `.metadata`, and the default load planner reads non-tensor entries with
`torch.load(weights_only=False)`: a run dir from someone else could run code. Here the metadata goes
through a pure-Python unpickler that resolves only an explicit list of (module, name) pairs and
builds state only into instances of DCP's own dataclasses (as torch's weights_only unpickler does),
under bounds checked while it reads (checkpoint/dcp_metadata.py: the file's size, the stack, nested
MARKs, each tuple's length and nesting, each list's and dict's length, dict keys of two kinds with
few of any one hash, integer widths), then the result is checked as a schema before any shard is
opened. Byte entries go through torch.load(weights_only=True). Every refusal is a UserError.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
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

from torchcls.checkpoint import dcp_metadata as bounds
from torchcls.checkpoint.dcp_metadata import check_layout, is_index, is_shape
from torchcls.errors import UserError
from torchcls.io_files import read_bytes

_DCP_TYPES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
              "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
# Every global a DCP .metadata may name, as exact (module, name) pairs. A name is looked up as one
# attribute, never as a dotted path: protocol 4 lets a pickle ask for `Metadata.__init__.__class__`
# (the function type), and from the function and code types it can build and call anything. Each
# entry below is a data type or a pure lookup: calling it with any arguments runs no code of the file's.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _DCP_TYPES}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # private, but the old pickles name it
       ("torch", "Size"),
       ("torch.serialization", "_get_layout"),  # turns a layout's name back into torch.strided etc.
       ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
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


def _bound(ok: bool, what: str) -> None:
    if not ok:
        raise pickle.UnpicklingError(f"{what}: over the bounds of DCP metadata (checkpoint/dcp_metadata.py)")


class _MetadataUnpickler(pickle._Unpickler):
    """Resolves only ALLOWED_GLOBALS (anything else is refused before an object of it exists), calls only
    them, builds, appends and sets items only into the types DCP metadata holds, and refuses, while it
    reads, anything over the unpickling bounds of dcp_metadata.py."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._depth: dict[int, tuple[tuple, int]] = {}  # id -> (tuple, nesting) for tuples holding tuples
        self._hashes: dict[int, tuple[dict, dict[int, int]]] = {}  # id(dict) -> (dict, {key hash: count})
        self._built: dict[int, Any] = {}  # instances BUILD has filled: each once, and keys only once built

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

    def _made(self, obj: Any) -> Any:
        """An object an allowed callable returned: a torch.Size is a shape within the bounds."""
        _bound(type(obj) is not torch.Size or is_shape(obj), "a torch.Size")
        return obj

    # -- tuples: length and nesting bounded, so that no hash of one recurses deep ----------------
    def _tuple(self, items: list | tuple) -> tuple:
        _bound(len(items) <= bounds.MAX_TUPLE, f"a tuple of {len(items)} items")
        depth = 1 + max((self._depth[id(i)][1] if id(i) in self._depth else 1
                         for i in items if type(i) is tuple), default=0)
        _bound(depth <= bounds.MAX_TUPLE_DEPTH, "tuples nested in tuples")
        made = tuple(items)
        if depth > 1:
            self._depth[id(made)] = (made, depth)
        return made

    def load_tuple(self) -> None:
        items = self.pop_mark()  # before self.append is looked up: pop_mark rebinds it to the outer stack
        self.append(self._tuple(items))

    def load_tuple1(self) -> None:
        self.stack[-1] = self._tuple(self.stack[-1:])

    def load_tuple2(self) -> None:
        self.stack[-2:] = [self._tuple(self.stack[-2:])]

    def load_tuple3(self) -> None:
        self.stack[-3:] = [self._tuple(self.stack[-3:])]

    def load_long1(self) -> None:
        n = self.read(1)[0]
        _bound(n <= bounds.MAX_INT_BYTES, "an integer")
        self.append(pickle.decode_long(self.read(n)))

    def load_long4(self) -> None:
        raise pickle.UnpicklingError("LONG4: an integer wider than DCP metadata holds")

    # -- calls and instances ------------------------------------------------------------------
    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self._callable(self.stack[-1], "REDUCE")
        _bound(func is not OrderedDict or args == (), "OrderedDict with items")  # items come through SETITEMS
        self.stack[-1] = self._made(func(*args))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self._class(self.stack.pop(), "NEWOBJ")
        self.append(self._made(cls.__new__(cls, *args)))

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        cls = self._class(self.stack.pop(), "NEWOBJ_EX")
        self.append(self._made(cls.__new__(cls, *args, **_target(kwargs, (dict,), "NEWOBJ_EX kwargs"))))

    def _instantiate(self, klass: Any, args: list) -> None:
        _bound(klass is not OrderedDict or not args, "OrderedDict with items")
        self.append(self._made(self._class(klass, "OBJ")(*args)))

    def load_build(self) -> None:
        state, inst = self.stack.pop(), self.stack[-1]
        if id(inst) in self._built:
            raise pickle.UnpicklingError(f"BUILD of a {type(inst).__name__} twice")
        self._built[id(inst)] = inst
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

    # -- containers: lengths bounded; dict keys of two kinds, few of any one hash ------------------
    def load_append(self) -> None:
        value = self.stack.pop()
        target = _target(self.stack[-1], (list,), "APPEND")
        _bound(len(target) < bounds.MAX_ENTRIES, "a list")
        target.append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        target = _target(self.stack[-1], (list,), "APPENDS")
        _bound(len(target) + len(items) <= bounds.MAX_ENTRIES, "a list")
        target.extend(items)

    def _admit(self, target: dict, key: Any) -> None:
        """Check `key` before `target` hashes it: a str (or a built MetadataIndex within the bounds)."""
        if type(key) is not str and not (is_index(key) and id(key) in self._built):
            raise pickle.UnpicklingError(f"a dict key of type {type(key).__name__}: DCP metadata keys are names "
                                         "and MetadataIndex entries")
        _bound(len(target) < bounds.MAX_ENTRIES, "a dict")
        counts = self._hashes.setdefault(id(target), (target, {}))[1]
        h = hash(key)
        counts[h] = counts.get(h, 0) + 1
        _bound(counts[h] <= bounds.MAX_SAME_HASH, f"{counts[h]} dict keys of one hash")

    def _set_items(self, target: dict, items: list) -> None:
        for i in range(0, len(items) - 1, 2):
            self._admit(target, items[i])
            target[items[i]] = items[i + 1]

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._set_items(_target(self.stack[-1], (dict, OrderedDict), "SETITEM"), [key, value])

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._set_items(_target(self.stack[-1], (dict, OrderedDict), "SETITEMS"), items)

    def load_dict(self) -> None:
        made: dict = {}
        self._set_items(made, self.pop_mark())
        self.append(made)

    def _refuse_sets(self) -> None:
        raise pickle.UnpicklingError("a set: DCP metadata holds none (and hashing its items is the attack)")


_OPS = ((pickle.REDUCE, "reduce"), (pickle.NEWOBJ, "newobj"), (pickle.NEWOBJ_EX, "newobj_ex"), (pickle.BUILD, "build"),
        (pickle.APPEND, "append"), (pickle.APPENDS, "appends"), (pickle.SETITEM, "setitem"),
        (pickle.SETITEMS, "setitems"), (pickle.DICT, "dict"), (pickle.TUPLE, "tuple"), (pickle.TUPLE1, "tuple1"),
        (pickle.TUPLE2, "tuple2"), (pickle.TUPLE3, "tuple3"), (pickle.LONG1, "long1"), (pickle.LONG4, "long4"),
        (pickle.EMPTY_SET, "_refuse_sets"), (pickle.ADDITEMS, "_refuse_sets"), (pickle.FROZENSET, "_refuse_sets"))


def _stack_bounded(op: Any) -> Any:
    """Every opcode: after it, the stack and the nested MARKs are within their bounds."""
    def run(self: _MetadataUnpickler) -> None:
        op(self)
        _bound(len(self.stack) <= bounds.MAX_STACK, "the unpickler's stack")
        _bound(len(self.metastack) <= bounds.MAX_MARKS, "nested MARKs")
    return run


_MetadataUnpickler.dispatch.update({op[0]: getattr(_MetadataUnpickler, name if name.startswith("_") else f"load_{name}")
                                    for op, name in _OPS})
_MetadataUnpickler.dispatch = {code: _stack_bounded(fn) for code, fn in _MetadataUnpickler.dispatch.items()}


def _shown(e: Exception) -> str:
    return repr(str(e)[:200])[1:-1]  # the text comes from the file: no control characters reach the terminal


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # FileSystemReader's file names: .metadata, or __{rank}.metadata per rank
        path = Path(str(self.path)) / (".metadata" if rank is None else f"__{rank}.metadata")
        # A regular file (no link, FIFO or device), its size bounded before a byte is read.
        data = read_bytes(path, max_bytes=bounds.MAX_METADATA_BYTES, what="DCP .metadata", follow_symlinks=False)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as e:  # noqa: BLE001 - whatever a crafted file makes an allowed type raise
            raise UserError(f"{self.path}: refused to load its .metadata ({type(e).__name__}: {_shown(e)}); "
                            "a distributed checkpoint holds only DCP metadata types, so this one is damaged or "
                            "was not written by torch.distributed.checkpoint. Nothing from it was run") from None
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
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set_path(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Put `value` at `path` (keys and list indices) in the nested state dict, making the dicts and lists on the
    way (what DCP's own flattening undoes: its helper for this is private)."""
    node: Any = root
    for key, nxt in zip(path, path[1:]):
        empty: Any = {} if isinstance(nxt, str) else []
        if isinstance(node, dict):
            node = node.setdefault(key, empty)
            continue
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


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

"""Loading a distributed (DCP) checkpoint without unpickling anything but its own data types.

torch's FileSystemReader.read_metadata is a plain `pickle.load` of `.metadata`, and the default
load planner reads non-tensor entries with `torch.load(weights_only=False)`: a run dir from
someone else could run code on `--resume` or `torchcls consolidate`. Here the metadata goes
through an unpickler that resolves only an explicit list of (module, name) pairs (as weights_only
does for torch.load) and refuses any other global before an object of it is built; byte entries go
through torch.load(weights_only=True).
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only ALLOWED_GLOBALS; anything else is refused before an object of it exists."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, AttributeError, EOFError, ImportError) as e:
                raise UserError(f"{self.path}: refused to load its .metadata ({e}); a distributed checkpoint "
                                "holds only DCP metadata types, so this one is damaged or was not written by "
                                "torch.distributed.checkpoint. Nothing from it was run") from None
        if not isinstance(metadata, Metadata):
            raise UserError(f"{self.path}/.metadata is not DCP metadata ({type(metadata).__name__})")
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

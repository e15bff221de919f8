"""Loading a distributed (DCP) checkpoint without unpickling anything but its own data types.

torch's FileSystemReader.read_metadata is a plain `pickle.load` of `.metadata`, and the default
load planner reads non-tensor entries with `torch.load(weights_only=False)`: a run dir from
someone else could run code on `--resume` or `torchcls consolidate`. Here the metadata goes
through an unpickler that only admits DCP's metadata classes (as weights_only does for
torch.load), and byte entries through torch.load(weights_only=True).
"""

from __future__ import annotations

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

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint._extension",
                "torch.distributed.checkpoint.storage")
_PLAIN = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("torch", "Size"),
          ("builtins", "slice"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
          ("torch.serialization", "_get_layout")}  # turns a layout's name back into torch.strided etc.


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module in _DCP_MODULES:  # its classes (dataclasses, enums) only: rebuilding them runs no code of ours
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")


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

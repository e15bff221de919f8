"""Checkpoint files: weights as safetensors (with the model spec, classes and preprocessing in its
metadata), the training state beside them as one more safetensors file (tensors, and the rest as JSON
in its metadata: checkpoint/state_file.py). Nothing is unpickled by default. Every write is atomic:
temp file, fsync, rename. Everything read back is bounded before it is used: the metadata's fields
(checkpoint/meta_check.py) and the weights' shapes against the model it names (checkpoint/fit.py),
before the model is built.

The names of the files in runs/<name>/checkpoints/ are declared here once; the Checkpointer
(checkpoint/checkpointer.py) decides when each is written and read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from torchcls.checkpoint.fit import fit_problems, fitted_model, misfit, read_header
from torchcls.checkpoint.meta_check import meta_fields
from torchcls.checkpoint.state_file import encode_state, read_legacy_state, read_state
from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError
from torchcls.io_files import regular_path
from torchcls.models.registry import ModelSpec
from torchcls.run_files import replace_file

META_KEY = "torchcls"
LINEAGE_KEY = "torchcls.lineage"  # the run's lineage (governance), stamped into the weights when saved

CHECKPOINTS = "checkpoints"  # runs/<name>/checkpoints/
LAST = "last.safetensors"  # the latest weights
BEST = "best.safetensors"  # the weights of the best validation top-1
LAST_STATE = "last.state.safetensors"  # one process: weights, optimizer, scheduler, progress, RNG, extras
LEGACY_STATE = "last.state.pt"  # the same, pickled by torch.save (before the safetensors format)
LAST_DCP = "last.dcp"  # torchrun: the sharded training state (DCP), weights included


@dataclass
class CheckpointMeta:
    spec: ModelSpec
    classes: list[str]
    preprocess: Preprocess
    config: dict[str, Any]  # the resolved training config (data source, split seed, ...)
    epoch: int
    step: int
    thresholds: list[float] | None = None  # multilabel: per-label decision thresholds (torchcls.tasks)

    @property
    def task(self) -> str:
        """multiclass or multilabel: the training run's --task."""
        return self.config.get("data", {}).get("task", "multiclass")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "checkpoint") -> CheckpointMeta:
        """From JSON read from `where` (a file): every field is checked against its bound first (UserError)."""
        return cls(**meta_fields(text, where))


def atomic_write(path: Path, write: callable) -> None:
    """Call write(tmp_path), fsync, then rename over `path`: readers never see half a file, and a link at
    `path` (a received run dir's) is replaced, never written through (run_files.replace_file; mode 0600).
    A failure (no permission, disk full) leaves `path` as it was and is raised as a WriteError naming `path`."""
    replace_file(path, write, durable=True, private=True)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain, contiguous, de-aliased CPU state dict (what safetensors can store)."""
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    return plain_state(model.state_dict())


def plain_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of plain tensors. A wrapper tensor subclass holding one tensor (torchao's
    weight that FSDP2 all-gathers in FP8) is unwrapped to it: it has no storage safetensors could read
    (torch 2.11 + torchao 0.17 handed it out from the full state dict). A DTensor is not unwrapped: its
    local tensor is a shard, not the weight."""
    from torchcls.checkpoint.subclass import inner_tensor

    return {k: inner_tensor(v).detach().to("cpu").contiguous().clone() for k, v in state.items()}


def write_weights(path: Path, state: dict[str, torch.Tensor], meta: CheckpointMeta,
                  lineage: dict[str, Any] | None = None) -> None:
    metadata = {META_KEY: meta.to_json()}
    if lineage is not None:
        metadata[LINEAGE_KEY] = json.dumps(lineage, sort_keys=True)
    atomic_write(path, lambda tmp: save_file(state, tmp, metadata=metadata))


def save_weights(path: Path, model: nn.Module, meta: CheckpointMeta, lineage: dict[str, Any] | None = None) -> None:
    write_weights(path, model_state(model), meta, lineage)


def save_training_state(path: Path, state: dict[str, Any]) -> None:
    """`state` (nested dicts, lists, tuples, scalars and tensors, with an int "step") as one safetensors file."""
    tensors, metadata = encode_state(state)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def load_training_state(path: Path, unsafe_unpickle: bool = False) -> dict[str, Any]:
    """The state `save_training_state` wrote; a LEGACY_STATE pickle only with `unsafe_unpickle`."""
    if not path.exists():
        raise UserError(f"training state {path} is missing: cannot resume (the weights alone are not enough)")
    if path.name == LEGACY_STATE:
        return read_legacy_state(path, unsafe_unpickle)
    return read_state(path)


def read_meta(path: str | Path) -> CheckpointMeta:
    return read_checkpoint_header(path)[0]


def read_checkpoint_header(path: str | Path) -> tuple[CheckpointMeta, dict[str, tuple[int, ...]]]:
    """A checkpoint's metadata (every field bounded) and its tensors' shapes, from the file's header alone."""
    path = Path(path)
    if not path.exists():  # (a FIFO or device exists: the header reader refuses it, saying what it is)
        raise UserError(f"checkpoint {path} does not exist")
    metadata, shapes = read_header(path)
    if META_KEY not in metadata:
        raise UserError(f"{path} has no torchcls metadata: it was not written by `torchcls train`")
    return CheckpointMeta.from_json(metadata[META_KEY], str(path)), shapes


def read_meta_json(path: Path) -> CheckpointMeta:
    """The CheckpointMeta of a JSON file (a DCP dir's meta.json): a regular file, size-bounded, fields checked."""
    from torchcls.checkpoint.meta_check import META_BOUNDS
    from torchcls.io_files import read_bytes

    return CheckpointMeta.from_json(read_bytes(path, max_bytes=META_BOUNDS.max_bytes, what="checkpoint metadata"),
                                    str(path))


def load_model(path: str | Path) -> tuple[nn.Module, CheckpointMeta]:
    """Rebuild the model a checkpoint describes and load its weights (eval mode, CPU). The metadata's
    fields are bounded and the weights' shapes (from the file's header) compared with the model on the
    meta device before anything is allocated for it (checkpoint/fit.py)."""
    path = resolve_checkpoint(path)
    meta, shapes = read_checkpoint_header(path)
    model = fitted_model(meta.spec, shapes, path)
    load_weights_into(model, path)
    return model.eval(), meta


def load_weights_into(model: nn.Module, path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Load the safetensors file `path` (or `state`, read from `path` already) into `model`, refusing
    with the mismatching keys named when it does not fit."""
    if state is None:
        with regular_path(path, what="checkpoint") as p:
            state = load_file(p)
    detail = fit_problems({k: tuple(v.shape) for k, v in model.state_dict().items()},
                          {k: tuple(v.shape) for k, v in state.items()})
    if detail:
        raise misfit(path, detail)
    model.load_state_dict(state)


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a .safetensors file or a run dir (→ its best, else last, checkpoint)."""
    path = Path(path)
    if path.is_dir():
        for name in (BEST, LAST):
            if (path / CHECKPOINTS / name).is_file():
                return path / CHECKPOINTS / name
        raise UserError(f"{path} holds no {CHECKPOINTS}/{BEST} or {LAST}: is it a run dir?")
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    return path


def run_dir_of(checkpoint: Path) -> Path | None:
    """runs/<name>/checkpoints/x.safetensors → runs/<name> (when it looks like a run dir). Found by name, not
    by resolving links: a received run dir's `checkpoints` -> ~/other/checkpoints must not make ~/other the
    folder that eval.json and report.html are written into."""
    parent = Path(os.path.abspath(checkpoint)).parent
    if parent.name == CHECKPOINTS and (parent.parent / "config.toml").is_file():
        return parent.parent
    return None


def output_dir_of(checkpoint: Path) -> Path:
    """Where evaluate, export and explain put what they make from `checkpoint` by default: the folder that holds
    its `checkpoints/` (a run dir, or one that lacks its config.toml), else the folder it lies in. Never the
    `checkpoints/` folder itself: in a received run dir it may be a link to another run's."""
    parent = Path(os.path.abspath(checkpoint)).parent
    return parent.parent if parent.name == CHECKPOINTS else parent

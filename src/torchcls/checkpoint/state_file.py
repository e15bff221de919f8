"""The single-process training state as one safetensors file: tensors as tensors, the rest as JSON.

One file is one commit: the weights, optimizer moments, scheduler, progress, RNG and extras (the
EMA) go into one atomically renamed file, so a kill can never pair new weights with old optimizer
state. Its safetensors metadata holds the tree around the tensors (checkpoint/state_tree.py) under
STATE_KEY and the optimizer step under STEP_KEY, readable from the header alone. Nothing in it is
unpickled. A state written before this format (last.state.pt, a torch.save pickle) is read only
with the opt-in flag UNSAFE_FLAG, through torch's restricted unpickler (weights_only=True).
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from torchcls.bounded_json import load_bounded
from torchcls.checkpoint import sharded_state
from torchcls.checkpoint.safetensors_bounds import METADATA, check_safetensors_header
from torchcls.checkpoint.state_tree import STATE_BOUNDS, flatten, unflatten
from torchcls.errors import UserError
from torchcls.io_files import regular_path

STATE_KEY = "torchcls.state"  # the JSON tree (state_tree.py)
STEP_KEY = "torchcls.step"  # the optimizer step, for saved_step without reading the tensors
FORMAT_KEY = "torchcls.format"
FORMAT = "training-state/1"
UNSAFE_FLAG = "--unsafe-unpickle"  # (checkpoint.unsafe_unpickle): read files that only a pickle reader can
_STEP = re.compile(r"[0-9]{1,19}")


def encode_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the safetensors metadata that hold `state` (which has an int "step")."""
    tree, tensors = flatten(state)
    metadata = {STATE_KEY: json.dumps(tree, allow_nan=False, separators=(",", ":")), STEP_KEY: str(state["step"]),
                FORMAT_KEY: FORMAT}
    return tensors, metadata


def read_state(path: Path) -> dict[str, Any]:
    """The training state of the safetensors file `path`, every part of it checked (UserError)."""
    from safetensors.torch import load_file

    metadata = _metadata(path)
    encoded = load_bounded(metadata[STATE_KEY], STATE_BOUNDS, f"training state {path}")
    with regular_path(path, what="training state") as p:
        tensors = load_file(p)  # its header passed check_safetensors_header: the sizes it allocates are the file's
    state = unflatten(encoded, tensors, f"training state {path}")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise UserError(f"training state {path} holds no step: the file is damaged or was not written by torchcls")
    return state  # a tree of values: check_state holds it to what a resume uses


# The parts a single-process state holds beside the progress fields: the run's own objects' state dicts, which
# Checkpointer.resume holds to this run's (sharded_state.like). Older states may lack the optional ones.
PARTS, OPTIONAL_PARTS = ("optimizer", "scheduler"), ("model", "extras", "precision")
# What to do about a state that fails a check (here or in Checkpointer.resume): it was damaged or crafted, and the
# run dir holds no other training state to resume from
RESUME_HINT = "start the run over without --resume (or from its best.safetensors with --pretrained)"


def check_state(state: Any, path: Path) -> dict[str, Any]:
    """`state` read from `path` (read_state, or an older run's pickle), its fixed fields checked as the sharded
    format's state.json's are (sharded_state): the progress counters typed and ranged, the RNG state a generator
    state, the epoch sums four float64 numbers, each part a dict and the weights tensors. Else a UserError."""
    where = f"training state {path}"
    if not isinstance(state, dict):
        raise UserError(f"{where} is not a dict of training state: the file is damaged or was not written by torchcls")
    sharded_state.progress(state, where)
    sharded_state.rng_state(state.get("rng"), where)
    for part in PARTS + tuple(p for p in OPTIONAL_PARTS if p in state):
        if type(state.get(part)) is not dict:
            raise UserError(f"{where}: {part} must be a dict (got {type(state.get(part)).__name__}): damaged or "
                            f"crafted; {RESUME_HINT}")
    if not all(type(k) is str and isinstance(v, torch.Tensor) for k, v in state.get("model", {}).items()):
        raise UserError(f"{where}: model must map parameter names to tensors: damaged or crafted; {RESUME_HINT}")
    sums = state.get("epoch_sums")
    if sums is not None and not (isinstance(sums, torch.Tensor) and sums.dtype == torch.float64
                                 and tuple(sums.shape) == (4,)):
        raise UserError(f"{where}: epoch_sums must be a float64 tensor of 4 numbers: damaged or crafted; {RESUME_HINT}")
    return state


def read_step(path: Path) -> int | None:
    """The optimizer step of the state file `path` from its header alone; None when it has none."""
    try:
        step = _metadata(path).get(STEP_KEY, "")
    except (UserError, OSError):
        return None
    return int(step) if _STEP.fullmatch(step) else None


def _metadata(path: Path) -> dict[str, str]:
    """The state file's safetensors metadata, its header checked under safetensors_bounds first."""
    header = check_safetensors_header(path)
    metadata = header.get(METADATA, {})
    if metadata.get(FORMAT_KEY) != FORMAT or STATE_KEY not in metadata:
        raise UserError(f"training state {path} is not in the format {FORMAT} (written by another torchcls?)")
    return metadata


def read_legacy_state(path: Path, unsafe_unpickle: bool) -> dict[str, Any]:
    """A state torch.save wrote (before the safetensors format): a pickle, read only when allowed."""
    if not unsafe_unpickle:
        raise UserError(f"training state {path} is a pickle (torch.save, written by an older torchcls) and pickles "
                        f"are not read by default. If you trust this run dir, resume once with {UNSAFE_FLAG} (torch's "
                        "restricted unpickler, weights_only=True): the next checkpoint is written pickle-free")
    try:
        with regular_path(path, what="training state") as p:
            return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"training state {path}: refused by torch's restricted unpickler (no code from it was "
                        f"run): {str(e).splitlines()[0][:200]}") from None
    except (RuntimeError, EOFError) as e:
        raise UserError(f"training state {path} is damaged ({str(e)[:200]})") from None

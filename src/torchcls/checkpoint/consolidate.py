"""`torchcls consolidate`: a sharded checkpoint (any world size) as one safetensors weights file.

One process, no process group. The checkpoint's meta.json is read with every field bounded
(files.read_meta_json), its shards' headers checked (hf_dcp.check_dir), and the model is built on
the CPU only once the saved shapes fit it (fit.fitted_model compares them on the meta device): what
is allocated is what the checkpoint's own files hold, never what a number in them asks for.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torchcls.checkpoint import dcp, hf_dcp, legacy_dcp
from torchcls.checkpoint.files import CHECKPOINTS, LAST_DCP, model_state, write_weights
from torchcls.checkpoint.fit import fitted_model
from torchcls.errors import UserError
from torchcls.run_files import refuse_links_below

MODEL = "model."  # the prefix of the model's tensors in the training state


def checkpoint_dir(source: Path) -> Path:
    """The sharded checkpoint of `source`: a run dir's checkpoints/last.dcp, or such a dir itself."""
    path = source / CHECKPOINTS / LAST_DCP if (source / CHECKPOINTS / LAST_DCP).is_dir() else source
    if not dcp.is_complete(path) or not (path / dcp.META).is_file():
        raise UserError(f"{source} is neither a run dir with {CHECKPOINTS}/{LAST_DCP}/ nor a torchcls DCP checkpoint")
    return path


def consolidate(source: str | Path, out: str | Path | None = None, *, unsafe_unpickle: bool = False) -> Path:
    """Load the model's tensors of the sharded checkpoint `source` (a run dir or a last.dcp dir) into the
    model its meta.json describes and write them as one safetensors file (default: beside last.dcp).
    `unsafe_unpickle`: a checkpoint in torch's older pickle format is read (restricted unpickler), else refused."""
    source = Path(source)
    path = checkpoint_dir(source)
    out = Path(out) if out else path.parent / "consolidated.safetensors"
    refuse_links_below(source, out)  # a received run dir's checkpoints -> ~/runs/prod/checkpoints: not written into
    legacy = dcp.is_legacy(path)
    if legacy and not unsafe_unpickle:
        dcp.refuse_legacy(path)
    meta = dcp.read_meta(path)
    shapes = (legacy_dcp.saved_shapes(path) if legacy
              else {k: s.size for k, s in hf_dcp.check_dir(path).items()})
    model = fitted_model(meta.spec, {k.removeprefix(MODEL): v for k, v in shapes.items() if k.startswith(MODEL)}, path)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        (legacy_dcp.load_model_tensors if legacy else hf_dcp.load)(state, path)
    model.load_state_dict(state["model"])
    write_weights(out, model_state(model), meta)
    return out

"""Start a model from pretrained weights: a torchcls checkpoint or run dir, a timm or torchvision
state dict (.safetensors; .pth/.pt/.bin are pickles, read only with --unsafe-unpickle, through
torch.load(weights_only=True)), a local folder
in the Hugging Face hub layout that timm reads (model.safetensors or pytorch_model.bin beside
config.json), or weights on the hub (`hf-hub:ORG/NAME`, or `hub`: --model's pretrained tag), fetched
through huggingface_hub's cache by models/hub.py and read here like a local file.

Where the data differs from the weights' origin: a classifier whose class count differs is
re-initialised, a first convolution whose channel count differs is adapted (timm's
adapt_input_conv: RGB weights summed for grey, repeated for more channels). Any other key whose
shape disagrees means another architecture: refused, naming the keys. timm-format weights (the
hub's, a hub folder's) first go through the model family's own checkpoint_filter_fn, as
timm.create_model(pretrained=True) does (a ViT's position embeddings resampled to another size).

A hub config (config.json) also gives the architecture (it becomes --model when that was left at
its default) and the input the backbone was trained on (timm's data config: `PretrainedInput`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.checkpoint.files import read_meta, resolve_checkpoint
from torchcls.checkpoint.safetensors_bounds import check_safetensors_header
from torchcls.data.preprocess import PretrainedInput
from torchcls.errors import UserError
from torchcls.io_files import open_regular, regular_path
from torchcls.models.hub import OWN_TAG, fetch, is_hub, read_timm_config

HUB_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors")
# Wrappers around a state dict that training scripts write (timm: state_dict / state_dict_ema).
CONTAINER_KEYS = ("state_dict", "model", "model_state", "model_state_dict", "module")
PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers


@dataclass(frozen=True)
class PretrainedSource:
    """Where the weights of --pretrained are, and what is known of them."""

    given: str  # the --pretrained value
    file: Path  # the weights file (inside the hub cache for hub weights)
    architecture: str | None = None  # the timm model they are for (a hub config, timm's registry)
    input: PretrainedInput | None = None  # what the backbone was trained on (timm's data config)
    hub: dict[str, str] | None = None  # weights from the hub: repo_id, revision (snapshot), cache
    timm_format: bool = False  # timm's checkpoint_filter_fn applies

    def as_dict(self) -> dict[str, Any]:
        return {"file": str(self.file), "architecture": self.architecture, "hub": self.hub,
                "input": None if self.input is None else self.input.__dict__}


def resolve_pretrained(value: str, model_name: str) -> PretrainedSource:
    """The weights --pretrained `value` names for --model `model_name`; hub weights are fetched (cache first)."""
    if is_hub(value):
        weights = fetch(value, model_name)
        label = value if value != OWN_TAG else f"hf-hub:{weights.pretrained_cfg.get('hf_hub_id')}"
        hub = {"repo_id": weights.repo_id, "revision": weights.revision, "cache": str(weights.weights.parents[2])}
        return PretrainedSource(value, weights.weights, weights.architecture,
                                _pretrained_input(label, weights.pretrained_cfg), hub, timm_format=True)
    file = weights_file(value)
    folder = Path(value)
    if file.parent == folder and (folder / "config.json").is_file():  # a hub folder (not a run dir)
        pretrained_cfg, architecture = read_timm_config(folder, value)
        return PretrainedSource(value, file, architecture, _pretrained_input(value, pretrained_cfg), timm_format=True)
    return PretrainedSource(value, file)


def model_for(model_name: str, source: PretrainedSource, default: str) -> str:
    """The --model to build for these weights: their own architecture when --model is `default` (was not
    given); a --model of another architecture is refused before anything is read."""
    if source.architecture is None:
        return model_name
    if model_name == default:
        return source.architecture
    if _arch(model_name) != _arch(source.architecture):
        raise UserError(f"--pretrained {source.given} holds weights of {source.architecture}, but --model is "
                        f"{model_name}; leave --model out (the weights name their architecture) or give "
                        f"--model {source.architecture}")
    return model_name


def _arch(name: str) -> str:
    return name.removeprefix("ee/").split(".", 1)[0]


def _pretrained_input(label: str, pretrained_cfg: dict[str, Any]) -> PretrainedInput | None:
    """timm's data config of the weights, or None when their config says nothing of the input."""
    if not any(k in pretrained_cfg for k in ("input_size", "mean", "interpolation", "crop_pct")):
        return None
    from timm.data import resolve_data_config

    return PretrainedInput.from_timm(label, resolve_data_config(pretrained_cfg=pretrained_cfg))


@dataclass
class LoadReport:
    source: str
    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    reinitialised: list[str] = field(default_factory=list)  # classifier keys: other number of classes
    adapted: list[str] = field(default_factory=list)  # first convolution: other number of channels
    origin: dict[str, Any] = field(default_factory=dict)  # PretrainedSource.as_dict(): file, hub, input

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "loaded": self.loaded, "missing": self.missing,
                "unexpected": self.unexpected, "reinitialised": self.reinitialised, "adapted": self.adapted,
                **self.origin}

    def summary(self) -> str:
        return (f"pretrained {self.source}: {self.loaded} tensors loaded, {len(self.missing)} missing, "
                f"{len(self.unexpected)} unexpected, classifier re-initialised: {len(self.reinitialised) > 0}, "
                f"first convolution adapted: {len(self.adapted) > 0}")


def weights_file(path: str | Path) -> Path:
    """The file holding the weights of `path`: itself, a run dir's best checkpoint, or a hub folder's file."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--pretrained {path} does not exist; pass a .safetensors/.pth file, a run dir or a "
                        "local Hugging Face hub folder")
    if path.is_dir():
        if (path / "checkpoints").is_dir():
            return resolve_checkpoint(path)
        for name in HUB_FILES:
            if (path / name).is_file():
                return path / name
        raise UserError(f"--pretrained {path}: a folder must be a torchcls run dir or hold one of "
                        f"{', '.join(HUB_FILES)} (the Hugging Face hub layout)")
    return path


def read_state_dict(path: str | Path, unsafe_unpickle: bool = False) -> dict[str, torch.Tensor]:
    """Tensors by name from a weights file. A file that is not safetensors is a pickle: read only with
    `unsafe_unpickle` (--unsafe-unpickle), and then by torch's restricted unpickler (weights_only=True)."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        check_safetensors_header(file, follow_symlinks=True)  # a hub cache links to its blobs
        try:
            with regular_path(file, what="--pretrained weights file") as checked:
                state = load_file(checked)
        except (SafetensorError, OSError) as e:
            raise UserError(f"--pretrained {file}: not a readable safetensors file ({e})") from None
    elif not unsafe_unpickle:
        raise UserError(f"--pretrained {file} is a pickle ({file.suffix or 'not .safetensors'}), and pickles are not read "
                        "by default: a crafted one can exploit the unpickler. Use the .safetensors file of these "
                        "weights, or, if you trust this file, add --unsafe-unpickle (torch's restricted unpickler, "
                        "weights_only=True)")
    else:
        try:
            with open_regular(file, what="--pretrained weights file") as f:
                state = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserError(f"--pretrained {file}: refused, it needs unpickling beyond tensors (no code from it "
                            f"was run): {str(e).splitlines()[0][:200]}. Convert it to .safetensors where you "
                            "trust it") from None
        except (RuntimeError, OSError, EOFError) as e:
            raise UserError(f"--pretrained {file}: not a readable torch weights file ({e})") from None
    return _unwrap(state, file)


def _unwrap(state: Any, file: Path) -> dict[str, torch.Tensor]:
    while isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        inner = next((state[k] for k in CONTAINER_KEYS if isinstance(state.get(k), dict)), None)
        if inner is None:
            break
        state = inner
    if not isinstance(state, dict) or not state:
        raise UserError(f"--pretrained {file}: holds no state dict of tensors")
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            for prefix in PREFIXES:
                key = key.removeprefix(prefix)
            out[key] = value
    return out


def load_pretrained(model: nn.Module, path: str | Path | PretrainedSource, num_classes: int,
                    classes: list[str] | None = None, unsafe_unpickle: bool = False) -> LoadReport:
    """Load `path` (any --pretrained form, or a resolved PretrainedSource) into `model` in place (see the
    module docstring for what is adapted). `classes`: the new data's class names; a torchcls checkpoint
    of other classes (even as many) gets a new classifier. `unsafe_unpickle`: see read_state_dict."""
    resolved = path if isinstance(path, PretrainedSource) else resolve_pretrained(str(path), _timm_name(model))
    path = resolved.file
    source = read_state_dict(path, unsafe_unpickle)
    if resolved.timm_format:
        source = _timm_filter(model, source)
    target = model.state_dict()
    report = LoadReport(resolved.given, origin=resolved.as_dict())
    usable: dict[str, torch.Tensor] = {}
    wrong: list[str] = []
    other_classes = classes is not None and _classes_of(path) not in (None, list(classes))
    head = _head_keys(model) if other_classes else set()
    for key, value in source.items():
        if key not in target:
            report.unexpected.append(key)
            continue
        want = target[key]
        if key in head:  # trained for other classes: its rows would name the wrong ones
            report.reinitialised.append(key)
        elif value.shape == want.shape:
            usable[key] = value
        elif _is_classifier(want, value, num_classes):
            report.reinitialised.append(key)
        elif _is_input_conv(want, value):
            from timm.models import adapt_input_conv  # (public: timm.models re-exports it)

            usable[key] = adapt_input_conv(want.shape[1], value)
            report.adapted.append(key)
        else:
            wrong.append(f"{key}: file {tuple(value.shape)} vs model {tuple(want.shape)}")
    report.missing = sorted(set(target) - set(usable) - set(report.reinitialised))
    # BatchNorm step counters are absent from some older checkpoints and carry no weights.
    absent = [k for k in report.missing if not k.endswith("num_batches_tracked")]
    if wrong or absent:
        detail = "; ".join(wrong[:5]) if wrong else (f"{len(absent)} of the model's {len(target)} tensors are not "
                                                      f"in it, e.g. {', '.join(absent[:3])}")
        raise UserError(f"--pretrained {resolved.given} does not fit this --model ({detail}); was it trained with another "
                        "architecture?")
    model.load_state_dict(usable, strict=False)
    report.loaded = len(usable)
    return report


def _timm_name(model: nn.Module) -> str:
    """A timm model's name with its pretrained tag (what the bare `hub` form resolves), else ''."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return ".".join(part for part in (cfg.get("architecture"), cfg.get("tag")) if part)


def _timm_filter(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's own conversion of checkpoints for this model family (the checkpoint_filter_fn its factory
    hands to timm's loader): e.g. a ViT's position embeddings resampled to this model's grid."""
    import sys

    module = type(model).__module__
    convert = getattr(sys.modules.get(module), "checkpoint_filter_fn", None) if module.startswith("timm.") else None
    return convert(dict(state), model) if convert is not None else state


def _classes_of(path: str | Path) -> list[str] | None:
    """The class names a torchcls checkpoint was trained on (None for other weights files)."""
    file = weights_file(path)
    if file.suffix != ".safetensors":
        return None
    try:
        return list(read_meta(file).classes)
    except UserError:  # a timm / torchvision / hub file: no torchcls metadata
        return None


def _head_keys(model: nn.Module) -> set[str]:
    from torchcls.models.parts import head_parameter_ids

    ids = head_parameter_ids(model)
    return {name for name, p in model.named_parameters() if id(p) in ids}


def _is_classifier(want: torch.Tensor, have: torch.Tensor, num_classes: int) -> bool:
    # The last layer's weight (K, D) or bias (K,): only the class count differs.
    return (want.shape[0] == num_classes and have.shape[0] != num_classes and want.dim() == have.dim()
            and want.shape[1:] == have.shape[1:])


def _is_input_conv(want: torch.Tensor, have: torch.Tensor) -> bool:
    return (want.dim() == 4 and have.dim() == 4 and want.shape[0] == have.shape[0]
            and want.shape[2:] == have.shape[2:] and want.shape[1] != have.shape[1])

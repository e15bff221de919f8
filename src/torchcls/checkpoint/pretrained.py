"""Start a model from pretrained weights (--pretrained): a torchcls checkpoint or run dir, a timm or
torchvision state dict (.safetensors; .pth/.pt/.bin are pickles, read only with --unsafe-unpickle), a local
folder in the Hugging Face hub layout that timm reads (model.safetensors or pytorch_model.bin beside
config.json), or weights on the hub (`hf-hub:ORG/NAME`, or `hub`: --model's pretrained tag), found in
huggingface_hub's cache (or fetched into it) by models/hub.py and then read like a local file.

A timm model is built and loaded by timm: `timm.create_model(name, pretrained=True,
pretrained_cfg_overlay=dict(file=...))` runs the family's checkpoint_filter_fn (a ViT's position
embeddings resampled to another input size), adapts the first convolution to the data's channels (RGB
weights summed for grey, repeated for more) and loads every tensor strictly: a file of another
architecture is refused, naming the tensors. What is left here is what timm does not do:
- find the weights file of a run dir, a hub folder, the hub cache;
- refuse a pickle without --unsafe-unpickle, and check a safetensors header against its bounds, before
  timm opens the file (`checked_weights`); timm then picks its reader by the name's suffix: safetensors'
  load_file, or torch.load(weights_only=True) (argparse.Namespace allowed, as in timm's checkpoints);
- a new classifier (timm's reset_classifier) where the data has other classes than the weights, also
  as many other ones (a torchcls checkpoint names its classes);
- torchcls's own models and torchvision's, which timm does not build: their state dict is matched
  here key by key (`load_pretrained`), with the same rules.

A hub config (config.json) also gives the architecture (it becomes --model when that was left at
its default) and the input the backbone was trained on (timm's data config: `PretrainedInput`).
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from torchcls.checkpoint.files import read_meta, resolve_checkpoint
from torchcls.checkpoint.safetensors_bounds import check_safetensors_header
from torchcls.data.preprocess import PretrainedInput
from torchcls.errors import UserError
from torchcls.io_files import regular_path
from torchcls.models.hub import OWN_TAG, fetch, is_hub, read_timm_config
from torchcls.models.registry import ModelSpec, create_model, is_timm_name

HUB_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors")
# Wrappers around a state dict that timm's load_state_dict does not open (it opens state_dict_ema,
# model_ema, state_dict and model): other training scripts' names.
CONTAINER_KEYS = ("model_state", "model_state_dict", "module", "state_dict", "model")


@dataclass(frozen=True)
class PretrainedSource:
    """Where the weights of --pretrained are, and what is known of them."""

    given: str  # the --pretrained value
    file: Path  # the weights file (inside the hub cache for hub weights)
    architecture: str | None = None  # the timm model they are for (a hub config, timm's registry)
    input: PretrainedInput | None = None  # what the backbone was trained on (timm's data config)
    hub: dict[str, str] | None = None  # weights from the hub: repo_id, revision (snapshot), cache
    pretrained_cfg: dict[str, Any] | None = None  # timm's config of the weights (hub, hub folder)

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
                                _pretrained_input(label, weights.pretrained_cfg), hub, weights.pretrained_cfg)
    file = weights_file(value)
    folder = Path(value)
    if file.parent == folder and (folder / "config.json").is_file():  # a hub folder (not a run dir)
        pretrained_cfg, architecture = read_timm_config(folder, value)
        return PretrainedSource(value, file, architecture, _pretrained_input(value, pretrained_cfg),
                                pretrained_cfg=pretrained_cfg)
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
    """timm's data config of the weights, or None when their config says nothing of the input. Its values
    come from a hub repository's or a folder's config.json: from_timm holds them to the bounds of checkpoint
    metadata (data/preprocess.check_input) and names `label` and the field of one out of them."""
    if not any(k in pretrained_cfg for k in ("input_size", "mean", "std", "interpolation", "crop_pct")):
        return None
    from timm.data import resolve_data_config

    return PretrainedInput.from_timm(label, resolve_data_config(pretrained_cfg=pretrained_cfg))


@dataclass
class LoadReport:
    source: str
    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    reinitialised: list[str] = field(default_factory=list)  # classifier keys: other classes
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


@contextmanager
def checked_weights(file: Path, given: str, unsafe_unpickle: bool) -> Iterator[tuple[str, dict | None]]:
    """(path, safetensors header or None) of `file`, for timm, which opens a path and picks its reader by
    the name's suffix. A pickle is refused unless `unsafe_unpickle`, before anything opens it. The file is
    opened once and the path handed out is a link named with its suffix to that open file
    (/proc/self/fd/N, see io_files.regular_path), so timm reads the very file whose header was checked
    here against its bounds, whatever replaces the name meanwhile."""
    if file.suffix != ".safetensors" and not unsafe_unpickle:
        raise UserError(f"--pretrained {given}: {file} is a pickle ({file.suffix or 'not .safetensors'}), and pickles "
                        "are not read by default: a crafted one can exploit the unpickler. Use the .safetensors "
                        "file of these weights, or, if you trust this file, add --unsafe-unpickle (torch's "
                        "restricted unpickler, weights_only=True)")
    with regular_path(file, what="--pretrained weights file") as opened, \
            tempfile.TemporaryDirectory(prefix="torchcls-weights-") as tmp:
        link = Path(tmp) / f"weights{file.suffix}"
        link.symlink_to(opened)
        try:
            header = check_safetensors_header(link, follow_symlinks=True) if file.suffix == ".safetensors" else None
        except UserError as e:
            raise UserError(str(e).replace(str(link), str(file))) from None
        yield str(link), header


def pretrained_model(spec: ModelSpec, source: str | Path | PretrainedSource, classes: list[str] | None = None,
                     unsafe_unpickle: bool = False) -> tuple[nn.Module, LoadReport]:
    """The model `spec` names, with the weights of `source` (any --pretrained form, or a resolved one).
    `classes`: the new data's class names; a torchcls checkpoint of other classes (even as many) gets a
    new classifier. `unsafe_unpickle`: --unsafe-unpickle (see checked_weights)."""
    if not isinstance(source, PretrainedSource):
        source = resolve_pretrained(str(source), spec.name)
    if not is_timm_name(spec.name) or spec.exits:
        model = create_model(spec)
        return model, load_pretrained(model, source, spec.num_classes, classes, unsafe_unpickle)
    from timm.models import get_pretrained_cfg

    default = get_pretrained_cfg(spec.name)  # the architecture's own layer names (code, not the file's config)
    classifier, first_conv = (_first(getattr(default, k, None)) for k in ("classifier", "first_conv"))
    weights_cfg = source.pretrained_cfg or {}
    with checked_weights(source.file, source.given, unsafe_unpickle) as (path, header):
        have_classes = (_rows(header, classifier, 0) or _count(weights_cfg.get("num_classes"))
                        or getattr(default, "num_classes", None) or spec.num_classes)
        have_chans = _rows(header, first_conv, 1) or _count((weights_cfg.get("input_size") or [None])[0]) or 3
        # The weights' own class count, so that timm loads every tensor strictly (with another count it
        # drops the classifier and loads the rest leniently); the head is replaced below.
        size = tuple(getattr(default, "input_size", None) or (3, 224, 224))[1:]
        overlay = dict(file=path, source="", custom_load=False, label_offset=0, num_classes=have_classes,
                       input_size=(have_chans, *size), classifier=classifier, first_conv=first_conv)
        try:
            model = create_model(replace(spec, num_classes=have_classes), pretrained_cfg_overlay=overlay)
        except (RuntimeError, ValueError, KeyError, EOFError, OSError, pickle.UnpicklingError, SafetensorError) as e:
            raise _refused(e, source, spec.name) from None
    report = LoadReport(source.given, origin=source.as_dict())
    report.loaded = len(model.state_dict())
    if have_classes != spec.num_classes or _other_classes(source.file, classes):
        report.reinitialised = _new_classifier(model, spec.num_classes, source.given)
        report.loaded -= len(report.reinitialised)
    if first_conv and have_chans != spec.in_chans:
        report.adapted = [f"{first_conv}.weight"]
    return model, report


def _first(names: Any) -> str | None:
    """timm names a layer by a string, or several (a distilled ViT's two heads) by a tuple: the first."""
    names = names[0] if isinstance(names, (tuple, list)) and names else names
    return names if isinstance(names, str) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _rows(header: dict | None, layer: str | None, dim: int) -> int | None:
    """Dimension `dim` of `layer`'s weight in a safetensors header (classes: 0, input channels: 1)."""
    shape = ((header or {}).get(f"{layer}.weight") or {}).get("shape") if layer else None
    return _count(shape[dim]) if isinstance(shape, list) and len(shape) > dim else None


def _new_classifier(model: nn.Module, num_classes: int, given: str) -> list[str]:
    """timm's reset_classifier: a new head for `num_classes`; the names of the tensors it replaced."""
    if not callable(getattr(model, "reset_classifier", None)):
        raise UserError(f"--pretrained {given}: this timm model has no reset_classifier to replace its head for "
                        f"{num_classes} classes; fine-tune a classification model (timm.list_models())")
    before = model.state_dict(keep_vars=True)  # the parameters themselves: replaced ones are new objects
    model.reset_classifier(num_classes)
    return sorted(k for k, v in model.state_dict(keep_vars=True).items() if before.get(k) is not v)


def _refused(e: Exception, source: PretrainedSource, model_name: str | None = None) -> UserError:
    """A loading error of timm's (or torch's, safetensors') as one line that says what to do."""
    text = " ".join(str(e).split())[:400]
    cause = e if isinstance(e, pickle.UnpicklingError) else e.__cause__
    if isinstance(cause, pickle.UnpicklingError):  # torch's restricted unpickler met more than tensors
        why = str(cause).partition("WeightsUnpickler error:")[2].strip() or str(cause)
        return UserError(f"--pretrained {source.given}: refused, it needs unpickling beyond tensors (no code from it "
                         f"was run): {why.splitlines()[0][:200]}. Convert it to .safetensors where you trust it")
    if isinstance(e, KeyError):  # the family's conversion (timm's checkpoint_filter_fn) missed a tensor
        text = f"it has no tensor {text}, which timm's conversion of weights for this family reads"
    if model_name and (isinstance(e, KeyError) or "Error(s) in loading state_dict" in text):
        return UserError(f"--pretrained {source.given} does not fit this --model {model_name} ({text}); was it "
                         "trained with another architecture?")
    where = f", nor loaded into --model {model_name}" if model_name else ""
    return UserError(f"--pretrained {source.file}: not a readable weights file{where} ({text[:300]})")


def _other_classes(file: Path, classes: list[str] | None) -> bool:
    return classes is not None and _classes_of(file) not in (None, list(classes))


def read_state_dict(path: str | Path, unsafe_unpickle: bool = False) -> dict[str, torch.Tensor]:
    """Tensors by name from a weights file (or a run dir, a hub folder), read by timm's load_state_dict
    (its EMA weights where a training checkpoint has them; DDP and torch.compile prefixes removed)."""
    from timm.models import clean_state_dict, load_state_dict

    file = weights_file(path)
    with checked_weights(file, str(path), unsafe_unpickle) as (checked, _):
        try:
            state = load_state_dict(checked, weights_only=True)
        except (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError, SafetensorError) as e:
            raise _refused(e, PretrainedSource(str(path), file)) from None
    while isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        inner = next((state[k] for k in CONTAINER_KEYS if isinstance(state.get(k), dict)), None)
        if inner is None:
            break
        state = clean_state_dict(inner)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if isinstance(state, dict) else {}
    if not tensors:
        raise UserError(f"--pretrained {file}: holds no state dict of tensors")
    return tensors


def load_pretrained(model: nn.Module, source: str | Path | PretrainedSource, num_classes: int,
                    classes: list[str] | None = None, unsafe_unpickle: bool = False) -> LoadReport:
    """Load `source` into a model timm does not build (torchcls's own, torchvision's, early-exit) in place,
    by timm's rules: a classifier whose class count differs (or, from a torchcls checkpoint, whose classes
    do) is left new, a first convolution of other channels is adapted (timm's adapt_input_conv); any other
    tensor that is missing or of another shape refuses the file, naming the tensors."""
    from timm.models import adapt_input_conv

    if not isinstance(source, PretrainedSource):
        source = resolve_pretrained(str(source), "")
    target = model.state_dict()
    report = LoadReport(source.given, origin=source.as_dict())
    usable: dict[str, torch.Tensor] = {}
    wrong: list[str] = []
    head = _head_keys(model) if _other_classes(source.file, classes) else set()
    for key, value in read_state_dict(source.file, unsafe_unpickle).items():
        want = target.get(key)
        if want is None:
            report.unexpected.append(key)
        elif key in head:  # trained for other classes: its rows would name the wrong ones
            report.reinitialised.append(key)
        elif value.shape == want.shape:
            usable[key] = value
        elif _is_classifier(want, value, num_classes):
            report.reinitialised.append(key)
        elif _is_input_conv(want, value):
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
        raise UserError(f"--pretrained {source.given} does not fit this --model ({detail}); was it trained with "
                        "another architecture?")
    model.load_state_dict(usable, strict=False)
    report.loaded = len(usable)
    return report


def _classes_of(file: Path) -> list[str] | None:
    """The class names a torchcls checkpoint was trained on (None for other weights files)."""
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

"""Start a model from local pretrained weights: a torchcls checkpoint or run dir, a timm or
torchvision state dict (.safetensors; .pth/.pt/.bin only through torch.load(weights_only=True)),
or a local folder in the Hugging Face hub layout that timm reads (model.safetensors or
pytorch_model.bin beside config.json).

Where the data differs from the weights' origin: a classifier whose class count differs is
re-initialised, a first convolution whose channel count differs is adapted (timm's
adapt_input_conv: RGB weights summed for grey, repeated for more channels). Any other key whose
shape disagrees means another architecture: refused, naming the keys. Nothing is downloaded.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.errors import UserError

HUB_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors")
# Wrappers around a state dict that training scripts write (timm: state_dict / state_dict_ema).
CONTAINER_KEYS = ("state_dict", "model", "model_state", "model_state_dict", "module")
PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers


@dataclass
class LoadReport:
    source: str
    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    reinitialised: list[str] = field(default_factory=list)  # classifier keys: other number of classes
    adapted: list[str] = field(default_factory=list)  # first convolution: other number of channels

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "loaded": self.loaded, "missing": self.missing,
                "unexpected": self.unexpected, "reinitialised": self.reinitialised, "adapted": self.adapted}

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
            from torchcls.checkpoint.files import resolve_checkpoint

            return resolve_checkpoint(path)
        for name in HUB_FILES:
            if (path / name).is_file():
                return path / name
        raise UserError(f"--pretrained {path}: a folder must be a torchcls run dir or hold one of "
                        f"{', '.join(HUB_FILES)} (the Hugging Face hub layout)")
    return path


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors by name from a weights file; never unpickles anything but tensors and containers."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise UserError(f"--pretrained {file}: not a readable safetensors file ({e})") from None
    else:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
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


def load_pretrained(model: nn.Module, path: str | Path, num_classes: int,
                    classes: list[str] | None = None) -> LoadReport:
    """Load `path` into `model` in place (see the module docstring for what is adapted). `classes`: the
    new data's class names; a torchcls checkpoint of other classes (even as many) gets a new classifier."""
    source = read_state_dict(path)
    target = model.state_dict()
    report = LoadReport(str(path))
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
            from timm.models._manipulate import adapt_input_conv

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
        raise UserError(f"--pretrained {path} does not fit this --model ({detail}); was it trained with another "
                        "architecture?")
    model.load_state_dict(usable, strict=False)
    report.loaded = len(usable)
    return report


def _classes_of(path: str | Path) -> list[str] | None:
    """The class names a torchcls checkpoint was trained on (None for other weights files)."""
    file = weights_file(path)
    if file.suffix != ".safetensors":
        return None
    from torchcls.checkpoint.files import read_meta

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

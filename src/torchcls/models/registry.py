"""One name string → a model: 'smallnet', 'fastnet' (and its slim form), any timm name, or 'tv/<torchvision name>'.

Weights start from random init, nothing is downloaded: `num_classes` and input channels are adapted
to the data. For pretrained weights, checkpoint/pretrained.py passes timm a pretrained config that
names a weights file it has checked, and timm loads it into the timm model it builds.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from torchcls.data.label_bounds import MAX_CLASSES  # the class count a data source may declare
from torchcls.data.preprocess import MAX_IMG_SIZE, MAX_IN_CHANS  # the input's bounds, wherever it is read from
from torchcls.errors import UserError
from torchcls.models.fastnet import BLOCKS as FASTNET_BLOCKS
from torchcls.models.fastnet import WIDTHS as FASTNET_WIDTHS
from torchcls.models.fastnet import FastNet
from torchcls.models.smallnet import SmallNet

TORCHVISION_PREFIX = "tv/"
EARLY_EXIT_PREFIX = "ee/"

# Bounds on every ModelSpec, checked before a model is built (`check_spec`): a spec read from a file
# (checkpoint metadata, a DCP dir's meta.json) must not size an allocation with a number nobody bounded.
# Training checks the same bounds, so every checkpoint torchcls writes is one it reads back.
MAX_EXITS = 16  # early exits; a backbone offers at most one per stage boundary (a ResNet has 3)
MAX_NAME = 256  # characters of a model name (timm's longest is under 80)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild the architecture; saved in every checkpoint."""

    name: str
    num_classes: int
    in_chans: int
    img_size: int
    drop_rate: float = 0.0
    exits: int = 0  # early-exit models ('ee/<backbone>'): intermediate exits, 0 = every stage boundary
    exit_threshold: float = 0.9  # early-exit models: softmax confidence at which a sample leaves
    drop_path_rate: float = 0.0  # stochastic depth of timm models (training only; eval is unaffected)


def create_model(spec: ModelSpec, pretrained_cfg_overlay: dict[str, Any] | None = None) -> nn.Module:
    """The model `spec` names. `pretrained_cfg_overlay` (timm models only): timm.create_model(pretrained=True,
    pretrained_cfg_overlay=...), timm's own loading of the weights file it names (see checkpoint/pretrained.py)."""
    check_spec(spec)
    if pretrained_cfg_overlay is not None:
        if not is_timm_name(spec.name) or spec.exits:
            raise ValueError(f"pretrained_cfg_overlay is for timm models, not {spec.name}")
        return _timm_model(spec, pretrained_cfg_overlay)
    if spec.name.startswith(EARLY_EXIT_PREFIX) or spec.exits:
        return _early_exit_model(spec)
    if spec.drop_path_rate:
        _check_drop_path(spec)
    if spec.name == "smallnet":
        return SmallNet(spec.num_classes, spec.in_chans, drop_rate=spec.drop_rate)
    if spec.name in FASTNET_WIDTHS:
        return FastNet(spec.num_classes, spec.in_chans, drop_rate=spec.drop_rate, widths=FASTNET_WIDTHS[spec.name],
                       blocks=FASTNET_BLOCKS.get(spec.name, (1, 1)))
    if spec.name.startswith(TORCHVISION_PREFIX):
        return _torchvision_model(spec)
    return _timm_model(spec)


_INTS = {"num_classes": (1, MAX_CLASSES), "in_chans": (1, MAX_IN_CHANS), "img_size": (1, MAX_IMG_SIZE),
         "exits": (0, MAX_EXITS)}
_FLOATS = {"drop_rate": (0.0, 1.0), "exit_threshold": (0.0, 1.0), "drop_path_rate": (0.0, 1.0)}  # closed ranges
_FLAGS = {"in_chans": "--channels", "img_size": "--img-size", "exits": "--exits", "drop_rate": "--drop-rate",
          "exit_threshold": "--exit-threshold", "drop_path_rate": "--drop-path"}  # where a user sets each one


def check_spec(spec: ModelSpec, where: str = "model spec") -> None:
    """Refuse (UserError) a spec with a field of the wrong type or outside its bound (see MAX_*)."""
    if not isinstance(spec.name, str) or not 0 < len(spec.name) <= MAX_NAME:
        raise UserError(f"{where}: the model name must be a string of 1 to {MAX_NAME} characters")
    for name, (low, high) in _INTS.items():
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UserError(f"{where}: {_named(name)} must be an integer in [{low}, {high:,}], got {_show(value)}"
                            + (" (MAX_CLASSES in torchcls.data.label_bounds)" if name == "num_classes" else ""))
    for name, (low, high) in _FLOATS.items():
        value = getattr(spec, name)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not low <= value <= high):
            raise UserError(f"{where}: {_named(name)} must be a number in [{low}, {high}], got {_show(value)}")


def _named(field: str) -> str:
    """A spec field with the option that sets it: 'exit_threshold (--exit-threshold)'."""
    return f"{field} ({_FLAGS[field]})" if field in _FLAGS else field


def spec_from_dict(raw: Any, where: str) -> ModelSpec:
    """A ModelSpec from a file's JSON object, refused (UserError) unless every field is known and bounded."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: the model spec must be a JSON object")
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"{where}: unknown model-spec field {_show(unknown[0])} (written by a newer torchcls?)")
    missing = [name for name in ("name", "num_classes", "in_chans", "img_size") if name not in raw]
    if missing:
        raise UserError(f"{where}: the model spec lacks {', '.join(missing)}")
    spec = ModelSpec(**raw)
    check_spec(spec, where)
    return spec


def _show(value: Any) -> str:
    """A value for a message, cut short: it comes from a file."""
    if isinstance(value, int) and value.bit_length() > 64:  # (printing a huge int costs time of its own)
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _early_exit_model(spec: ModelSpec) -> nn.Module:
    from dataclasses import replace

    from torchcls.models.early_exit import build_early_exit

    if not spec.name.startswith(EARLY_EXIT_PREFIX):
        raise UserError(f"--exits {spec.exits} needs an early-exit model name: '{EARLY_EXIT_PREFIX}{spec.name}'")
    backbone_name = spec.name.removeprefix(EARLY_EXIT_PREFIX)
    backbone = create_model(replace(spec, name=backbone_name, exits=0))
    return build_early_exit(backbone_name, backbone, spec.num_classes, spec.exits, spec.exit_threshold)


def is_timm_name(name: str) -> bool:
    """Whether `name` is one timm builds (not a built-in, torchvision or early-exit name)."""
    return name not in ("smallnet", *FASTNET_WIDTHS) and not name.startswith((TORCHVISION_PREFIX, EARLY_EXIT_PREFIX))


def _timm_model(spec: ModelSpec, pretrained_cfg_overlay: dict[str, Any] | None = None) -> nn.Module:
    import timm

    if not timm.is_model(spec.name):
        raise UserError(_unknown(spec.name, timm.list_models()))
    kwargs = dict(pretrained=pretrained_cfg_overlay is not None, pretrained_cfg_overlay=pretrained_cfg_overlay,
                  num_classes=spec.num_classes, in_chans=spec.in_chans, drop_rate=spec.drop_rate)
    if spec.drop_path_rate:  # only when asked: not every timm family takes the argument
        kwargs["drop_path_rate"] = spec.drop_path_rate
    try:  # transformers need their input size; CNNs do not take the argument
        return timm.create_model(spec.name, img_size=spec.img_size, **kwargs)
    except TypeError:
        try:
            return timm.create_model(spec.name, **kwargs)
        except TypeError as e:
            if "drop_path_rate" not in str(e):
                raise
            raise UserError(f"--drop-path: timm model '{spec.name}' has no stochastic depth (drop_path_rate); "
                            "use --drop-path 0 or a residual family (resnet, convnext, vit, ...)") from None


def _check_drop_path(spec: ModelSpec) -> None:
    if not 0.0 <= spec.drop_path_rate < 1.0:
        raise UserError(f"--drop-path must be in [0, 1), got {spec.drop_path_rate}")
    backbone = spec.name.removeprefix(EARLY_EXIT_PREFIX)
    if backbone == "smallnet" or backbone.startswith(TORCHVISION_PREFIX):
        raise UserError(f"--drop-path applies to timm models (their drop_path_rate), not to '{backbone}'; "
                        "use --drop-path 0, or a timm model such as resnet18 or convnext_atto")


def _torchvision_model(spec: ModelSpec) -> nn.Module:
    import torchvision

    name = spec.name.removeprefix(TORCHVISION_PREFIX)
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise UserError(_unknown(spec.name, [TORCHVISION_PREFIX + n for n in available]))
    model = torchvision.models.get_model(name, weights=None, num_classes=spec.num_classes)
    if spec.in_chans != 3:
        _adapt_first_conv(model, spec.in_chans)
    return model


def _adapt_first_conv(model: nn.Module, in_chans: int) -> None:
    """Replace the first 3-channel convolution with one taking `in_chans` channels."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                setattr(parent, child_name, nn.Conv2d(
                    in_chans, child.out_channels, child.kernel_size, child.stride, child.padding,
                    child.dilation, child.groups, child.bias is not None, child.padding_mode))
                return
    raise UserError(f"cannot adapt this torchvision model to {in_chans} input channels; use --channels 3")


def _unknown(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known + ["smallnet", *FASTNET_WIDTHS], n=5, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return (f"unknown model '{name}'.{hint} Use 'smallnet', a timm name (timm.list_models()), "
            f"or '{TORCHVISION_PREFIX}<name>' for torchvision (e.g. {TORCHVISION_PREFIX}resnet18).")

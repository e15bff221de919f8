"""What an image needs before the model (`Preprocess`), and where each part of it comes from.

Without pretrained weights the data decides: its side (28 for the built-in sets, 224 for image
files) and its normalisation statistics. With a pretrained backbone whose data config is known
(timm's pretrained config, from the hub or a hub folder: `PretrainedInput`), the input follows what
the backbone was trained with: size, mean/std, interpolation and crop ratio. Flags the user gave
(--img-size, --channels) win over both; `resolve_preprocess` says which source won for each part.

`Preprocess` travels inside checkpoints and exported artifacts; fields added later have defaults
that reproduce what older checkpoints were trained with (bilinear, no crop margin).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchcls.config import DataConfig
from torchcls.data.sources import IMAGENET_STATS, STATS
from torchcls.errors import UserError

# Resize modes that torchvision runs on uint8 tensors; timm's others (lanczos, random) map to bicubic.
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


@dataclass(frozen=True)
class Preprocess:
    """Resize the short side to `resize_size` with `interpolation`, centre-crop `img_size`, normalise."""

    img_size: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    crop_pct: float = 1.0  # the centre crop's share of the resized side (timm's crop_pct; 1 = no margin)

    @property
    def resize_size(self) -> int:
        """The short side before the centre crop (timm: floor(img_size / crop_pct))."""
        return self.img_size if self.crop_pct >= 1.0 else math.floor(self.img_size / self.crop_pct)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Preprocess:
        """From checkpoint or artifact metadata (older ones lack interpolation and crop_pct)."""
        return cls(int(raw["img_size"]), int(raw["channels"]), tuple(map(float, raw["mean"])),
                   tuple(map(float, raw["std"])), str(raw.get("interpolation", "bilinear")),
                   float(raw.get("crop_pct", 1.0)))


@dataclass(frozen=True)
class PretrainedInput:
    """The input a pretrained backbone was trained on (timm's resolved data config)."""

    source: str  # where it came from, e.g. "hf-hub:timm/convnext_tiny.fb_in22k_ft_in1k"
    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str
    crop_pct: float

    @classmethod
    def from_timm(cls, source: str, data_config: dict[str, Any]) -> PretrainedInput:
        """From timm.data.resolve_data_config's dict (input_size, mean, std, interpolation, crop_pct)."""
        return cls(source, int(data_config["input_size"][-1]), tuple(map(float, data_config["mean"])),
                   tuple(map(float, data_config["std"])), str(data_config.get("interpolation", "bilinear")),
                   float(data_config.get("crop_pct") or 1.0))


def resolve_preprocess(cfg: DataConfig, images: Any,
                       pretrained: PretrainedInput | None = None) -> tuple[Preprocess, dict[str, str]]:
    """The preprocessing of a run, and which source set each part (`images`: an ImageSet or anything
    with `name`, `channels` and `side`)."""
    channels = cfg.channels or images.channels
    if channels not in (1, 3):
        raise UserError(f"--channels must be 1 or 3, got {channels}")
    chosen = {"channels": "--channels" if cfg.channels else "the data"}
    if cfg.img_size:
        size, chosen["img_size"] = cfg.img_size, "--img-size"
    elif pretrained is not None:
        size, chosen["img_size"] = pretrained.img_size, f"the pretrained config ({pretrained.source})"
    else:
        size, chosen["img_size"] = images.side or 224, "the data" if images.side else "built-in default"
    if cfg.img_size and pretrained is not None and pretrained.img_size != cfg.img_size:
        chosen["img_size"] += f" (the pretrained config says {pretrained.img_size})"
    if pretrained is None:
        mean, std = STATS.get(images.name, IMAGENET_STATS if channels == 3 else ((0.5,), (0.5,)))
        interpolation, crop_pct = "bilinear", 1.0
        chosen |= {"mean_std": "the data" if images.name in STATS else "built-in default",
                   "interpolation": "built-in default", "crop_pct": "built-in default"}
    else:
        mean, std, crop_pct = pretrained.mean, pretrained.std, pretrained.crop_pct
        interpolation = pretrained.interpolation if pretrained.interpolation in INTERPOLATIONS else "bicubic"
        by = f"the pretrained config ({pretrained.source})"
        chosen |= {"mean_std": by, "interpolation": by, "crop_pct": by}
    if len(mean) != channels:  # grey set shown as RGB or photos as grey: one value per channel
        mean, std = (sum(mean) / len(mean),) * channels, (sum(std) / len(std),) * channels
        chosen["mean_std"] += f" (averaged over channels for {channels} channel(s))"
    return Preprocess(size, channels, tuple(mean), tuple(std), interpolation, crop_pct), chosen


def describe(pre: Preprocess, chosen: dict[str, str]) -> str:
    """One line for the console: what the input is and where each part came from."""
    by_source: dict[str, list[str]] = {}
    for part, source in chosen.items():
        by_source.setdefault(source, []).append(part)
    sources = "; ".join(f"{', '.join(parts)} from {source}" for source, parts in by_source.items())
    return (f"preprocess: {pre.img_size} px, {pre.interpolation} resize to {pre.resize_size} + centre crop "
            f"(crop_pct {pre.crop_pct:g}), mean/std {_fmt(pre.mean)}/{_fmt(pre.std)} ({sources})")


def _fmt(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:.3g}" for v in values)

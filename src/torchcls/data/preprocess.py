"""What an image needs before the model (`Preprocess`), and where each part of it comes from.

Without pretrained weights the data decides: its side (28 for the built-in sets, 224 for image
files) and its normalisation statistics. With a pretrained backbone whose data config is known
(timm's pretrained config, from the hub or a hub folder: `PretrainedInput`), the input follows what
the backbone was trained with: size, mean/std, interpolation and crop ratio. Flags the user gave
(--img-size, --channels) win over both; `resolve_preprocess` says which source won for each part.

`Preprocess` travels inside checkpoints and exported artifacts; fields added later have defaults
that reproduce what older checkpoints were trained with (bilinear, no crop margin). Whatever file it
comes from (checkpoint or artifact metadata, a pretrained backbone's config.json), its values are held
to the bounds below by one check, `check_input`, before anything is sized by them.
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
# Bounds on a model's input (models/registry.py bounds every ModelSpec with the first two). Each image is
# decoded and resized to img_size / crop_pct px a side: a config's crop_pct of 0.001 made that 224,000 px.
MAX_IN_CHANS = 64  # grey, RGB, multispectral (Sentinel-2 has 13 bands) with room to spare
MAX_IMG_SIZE = 2048  # input side in pixels; timm's largest pretrained input is 1024
CROP_PCT = (0.5, 2.0)  # the resize side is img_size / crop_pct: at most twice the input (timm's range: 0.875-1.15)
MAX_STAT = 1e6  # |mean| and std of pixel values in [0, 1] (or [0, 255])


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
        """From timm.data.resolve_data_config's dict (input_size, mean, std, interpolation, crop_pct), each
        value held to the bounds of checkpoint metadata (`check_input`): they come from a hub repository's
        or a folder's config.json, as anyone wrote it. `source`: the hub name or folder, for the message."""
        where = f"--pretrained {source}: its pretrained config's"
        size, interpolation = data_config.get("input_size"), data_config.get("interpolation", "bilinear")
        if not (isinstance(size, (list, tuple)) and len(size) == 3 and int_in(size[1], 1, MAX_IMG_SIZE)):
            raise UserError(f"{where} input_size must be [channels, height, width] with each side an integer in "
                            f"[1, {MAX_IMG_SIZE}], got {_shown(size)}: refused before anything was built")
        if not isinstance(interpolation, str):
            raise UserError(f"{where} interpolation must be a name (e.g. bicubic), got {_shown(interpolation)}")
        crop_pct = data_config.get("crop_pct")
        value = {"channels": size[0], "img_size": size[2], "mean": data_config.get("mean"),
                 "std": data_config.get("std"), "crop_pct": 1.0 if crop_pct is None else crop_pct}
        check_input(value, None, where, names={"channels": "input_size channels", "img_size": "input_size width"})
        return cls(source, size[2], tuple(map(float, value["mean"])), tuple(map(float, value["std"])),
                   interpolation, float(value["crop_pct"]))


def check_input(value: dict[str, Any], in_chans: int | None, where: str, names: dict[str, str] | None = None) -> None:
    """img_size, channels, mean, std and crop_pct of `value` each in its range (the bounds above), checked
    before anything is sized by them; `in_chans` None: any channel count up to MAX_IN_CHANS. `where`
    starts the message (the file or source); `names`: what the source calls a field, if not its own name."""
    name = {"img_size": "img_size", "channels": "channels", **(names or {})}
    size, channels, mean, std = (value.get(k) for k in ("img_size", "channels", "mean", "std"))
    if not int_in(size, 1, MAX_IMG_SIZE):
        raise UserError(f"{where} {name['img_size']} must be an integer in [1, {MAX_IMG_SIZE}], got {_shown(size)}")
    if not int_in(channels, 1, MAX_IN_CHANS) or channels != (in_chans or channels):
        raise UserError(f"{where} {name['channels']} must be the model's {in_chans or f'1 to {MAX_IN_CHANS}'} input "
                        f"channels, got {_shown(channels)}")
    if not (_numbers(mean, channels) and _numbers(std, channels) and all(s > 0 for s in std)):
        raise UserError(f"{where} mean and std must hold {channels} finite number(s) each in [-{MAX_STAT:g}, "
                        f"{MAX_STAT:g}], std > 0, got {_shown(mean)} and {_shown(std)}")
    if not number_in(value.get("crop_pct"), *CROP_PCT):
        raise UserError(f"{where} crop_pct must be a number in [{CROP_PCT[0]}, {CROP_PCT[1]}] (the image is resized "
                        f"to img_size / crop_pct), got {_shown(value.get('crop_pct'))}")


def int_in(value: Any, low: int, high: int) -> bool:
    """`value` is an int (not a bool) in [low, high]: a check for numbers read from a file."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def number_in(value: Any, low: float, high: float) -> bool:
    """`value` is a finite int or float (not a bool) in [low, high]: a check for numbers read from a file."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def _numbers(value: Any, n: int) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == n
            and all(number_in(v, -MAX_STAT, MAX_STAT) for v in value))


def _shown(value: Any) -> str:
    return repr(value)[:80]


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

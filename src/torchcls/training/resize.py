"""Progressive resizing (--resize-schedule): the first epochs train on smaller images.

A convolution net's time per image scales with its pixels: FastNet trains about 2x faster at
20 px than at 28 px and 3x faster at 16 px. Early epochs, where the net learns coarse shapes,
lose little from the lower resolution; the last epochs at the full --img-size adapt the weights
and the BatchNorm statistics to the size the model is validated, saved and served at.

The schedule is a function of the epoch alone, so a resumed run trains each epoch at the same
size as an uninterrupted one. Each batch is resized where the model runs, after the feed's
augmentation (bilinear with antialiasing, as torchvision's Resize), whatever the feed: in-memory,
files or shards.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from torchcls.config import INT_RANGES
from torchcls.errors import UserError
from torchcls.models.registry import MAX_IMG_SIZE

FLAG = "--resize-schedule"
# Bounds of each part, checked as the option is parsed (a config file's resize_schedule too): a size is a training
# image side like --img-size (its bound, data/preprocess.MAX_IMG_SIZE: 40000 px made each batch 763 GiB whatever
# --img-size, which is None by default and then compared with nothing), and the epochs, one part's and all parts'
# together, a number of epochs like --epochs (config.INT_RANGES).
MIN_SIZE = 4  # px: what a network's stem can still downsample
MAX_EPOCHS = INT_RANGES[("train", "epochs")].hi


def parse_schedule(spec: str) -> list[tuple[int, int]]:
    """'SIZE:EPOCHS,...' as [(size, epochs), ...] in order; '' = no schedule. SIZE within MIN_SIZE..MAX_IMG_SIZE,
    EPOCHS >= 1 and all of them together within --epochs' range: a UserError naming the option, value and range."""
    stages: list[tuple[int, int]] = []
    total = 0
    for part in filter(None, (p.strip() for p in spec.split(","))):
        size, sep, epochs = part.partition(":")
        try:
            stage = (int(size), int(epochs))
        except ValueError:
            stage = (0, 0)
        shown = spec if len(spec) <= 200 else f"{spec[:200]}... ({len(spec):,} characters)"
        if not sep or stage[1] < 1 or stage[0] < 1:
            raise UserError(f"{FLAG} {shown!r}: each part is SIZE:EPOCHS with SIZE {MIN_SIZE} to {MAX_IMG_SIZE:,} px "
                            f"and EPOCHS >= 1, got {part[:60]!r} (e.g. '16:4,20:2': 4 epochs at 16 px, 2 at 20 px, "
                            "the rest at --img-size)")
        if not MIN_SIZE <= stage[0] <= MAX_IMG_SIZE:
            value = f"{stage[0]:,}" if stage[0] < 10**12 else f"of {len(str(stage[0]))} digits"
            raise UserError(f"{FLAG} {shown!r}: SIZE {value} px (in {part[:60]!r}) is outside the allowed range "
                            f"{MIN_SIZE} to {MAX_IMG_SIZE:,} px (data/preprocess.MAX_IMG_SIZE, as --img-size); each "
                            "part is SIZE:EPOCHS, e.g. '16:4,20:2'")
        total += stage[1]
        if total > MAX_EPOCHS:
            raise UserError(f"{FLAG} {shown!r}: its EPOCHS add up to {total:,} or more, outside the allowed range 1 "
                            f"to {MAX_EPOCHS:,} (that of --epochs, config.INT_RANGES); each part is SIZE:EPOCHS, "
                            "e.g. '16:4,20:2'")
        stages.append(stage)
    return stages


def check_schedule(spec: str, epochs: int, img_size: int | None) -> None:
    """Refuse a schedule that would never train at --img-size (the validated, saved and served size: the last
    epochs adapt the weights and BatchNorm statistics to it) or that would upsample."""
    stages = parse_schedule(spec)
    if stages and sum(n for _, n in stages) >= epochs:
        raise UserError(f"{FLAG} {spec!r} covers {sum(n for _, n in stages)} epoch(s) of --epochs {epochs}: leave at "
                        "least the last one at --img-size, which validation, checkpoints and serving use")
    if img_size is not None and (big := [size for size, _ in stages if size >= img_size]):
        raise UserError(f"{FLAG} {spec!r}: {big[0]} px is not smaller than --img-size {img_size}; the schedule's "
                        "sizes are the smaller images of the first epochs")


def size_at(stages: list[tuple[int, int]], epoch: int) -> int | None:
    """The training image size of 0-based `epoch`; None past the schedule (the model's own --img-size)."""
    end = 0
    for size, epochs in stages:
        end += epochs
        if epoch < end:
            return size
    return None


def resize_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) images resized to size x size, in x's memory format."""
    if x.shape[-2:] == (size, size):
        return x
    channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    out = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)

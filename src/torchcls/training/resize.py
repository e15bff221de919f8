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

from torchcls.errors import UserError

FLAG = "--resize-schedule"


def parse_schedule(spec: str) -> list[tuple[int, int]]:
    """'SIZE:EPOCHS,...' as [(size, epochs), ...] in order; '' = no schedule."""
    stages: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        size, sep, epochs = part.partition(":")
        try:
            stage = (int(size), int(epochs))
        except ValueError:
            stage = (0, 0)
        if not sep or stage[0] < 4 or stage[1] < 1:
            raise UserError(f"{FLAG} {spec!r}: each part is SIZE:EPOCHS with SIZE >= 4 px and EPOCHS >= 1, got "
                            f"{part!r} (e.g. '16:4,20:2': 4 epochs at 16 px, 2 at 20 px, the rest at --img-size)")
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

"""Augmentation presets applied to a whole batch at once, as tensor ops on any device.

The same families and ranges as the per-sample transforms.v2 presets (data/loaders.py):
a shift is RandomCrop(size, padding=size // 8) with zero fill, a flip is a horizontal mirror,
a resized crop is RandomResizedCrop(size, scale=(0.35, 1), ratio=(3/4, 4/3)) with bilinear
resampling. Random parameters are drawn by the caller, so one generator controls them all.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.nn import functional as F

RRC_SCALE, RRC_RATIO = (0.35, 1.0), (3 / 4, 4 / 3)  # the map-style RandomResizedCrop's ranges


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    # Ops on a few thousand numbers (the parameters; a batch of small images) run far slower on
    # two OpenMP threads than on one: the thread hand-off costs more than the work, and much more
    # when another process holds the other core. Images of real size keep the process's threads.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def shift_flip(u8: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor | None, pad: int) -> torch.Tensor:
    """RandomCrop(size, padding=pad) then an optional horizontal flip, per sample, as one gather.

    `shift` (B, 2) holds each crop's (top, left) in the zero-padded image, in [0, 2*pad].
    """
    b, c, h, w = u8.shape
    padded = F.pad(u8, (pad, pad, pad, pad))  # zeros, like RandomCrop's default fill
    wp = w + 2 * pad
    rows = shift[:, :1] + torch.arange(h, device=u8.device)  # (B, H)
    cols = shift[:, 1:] + torch.arange(w, device=u8.device)  # (B, W)
    if flip is not None:
        cols = torch.where(flip.to(u8.device)[:, None], cols.flip(1), cols)
    index = (rows[:, :, None] * wp + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
    return padded.reshape(b, c, -1).gather(2, index).view(b, c, h, w)


def resized_crop_boxes(b: int, size: int, gen: torch.Generator | None) -> torch.Tensor:
    """(B, 4) boxes (top, left, height, width) drawn as RandomResizedCrop draws them on a size x size image."""
    area, tries = size * size, 10
    target = area * torch.empty(b, tries).uniform_(*RRC_SCALE, generator=gen)
    log_ratio = torch.empty(b, tries).uniform_(math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1]), generator=gen)
    aspect = log_ratio.exp()
    w = (target * aspect).sqrt().round()
    h = (target / aspect).sqrt().round()
    ok = (w > 0) & (w <= size) & (h > 0) & (h <= size)
    first = ok.float().argmax(1)  # the first try that fits, as torchvision takes it
    pick = torch.arange(b)
    w, h = w[pick, first], h[pick, first]
    w = torch.where(ok.any(1), w, torch.full_like(w, size))  # the fallback on a square image: all of it
    h = torch.where(ok.any(1), h, torch.full_like(h, size))
    top = (torch.rand(b, generator=gen) * (size - h + 1)).floor()
    left = (torch.rand(b, generator=gen) * (size - w + 1)).floor()
    return torch.stack([top, left, h, w], dim=1)


def resized_crop_flip(x: torch.Tensor, box: torch.Tensor, flip: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Crop each image to its box and resize it to `size` x `size` (default: x's own size; bilinear),
    mirrored where `flip`.

    One grid_sample for the whole batch; a flip is a negative horizontal scale.
    """
    b, _, h, w = x.shape
    out_h, out_w = (size, size) if size else (h, w)
    top, left, bh, bw = box.unbind(1)
    # The crop is axis-aligned, so the grid is separable: build it from two 1-D ramps
    # (affine_grid's batched matmul costs more than the sampling itself on small images).
    ramp_x = (2 * torch.arange(out_w, device=x.device) + 1) / out_w - 1  # output pixel centres in [-1, 1]
    ramp_y = (2 * torch.arange(out_h, device=x.device) + 1) / out_h - 1
    scale_x = torch.where(flip, -bw / w, bw / w)
    gx = scale_x[:, None] * ramp_x + ((2 * left + bw) / w - 1)[:, None]  # (B, W): box centre + scaled ramp
    gy = (bh / h)[:, None] * ramp_y + ((2 * top + bh) / h - 1)[:, None]  # (B, H)
    grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), dim=-1)
    # "border" clamps at the image edge as a resize does, instead of blending in zeros.
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def alternating_flips(n: int, seed: int) -> torch.Tensor:
    """--augment flip-alternate (airbench): a seeded random half of the n samples, mirrored in even epochs;
    sample i is mirrored in epoch e iff `base[i] ^ (e % 2 == 1)`, so every image is seen both ways in every
    two epochs, which random flips leave to chance. Drawn from its own generator (the epoch generators'
    draws stay as they are)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(FLIP_SALT + seed)) < 0.5


def flips_at(base: torch.Tensor, positions: torch.Tensor, epoch: int) -> torch.Tensor:
    """Which of the samples at `positions` are mirrored in `epoch` (see alternating_flips)."""
    return base[positions] ^ bool(epoch % 2)


FLIP_SALT = 0x5F11_9A17  # the base flips' generator: not a seed any epoch's order uses for small seeds

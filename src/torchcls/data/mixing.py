"""Mixup and CutMix for the training step: timm's `Mixup` with the matching soft-target loss.

    mixing = build_mixing(cfg.data, cfg.optim.label_smoothing, num_classes, per_rank_batch, seed, rank)
    if mixing is not None:                      # None: --mixup 0 --cutmix 0, keep the plain loss
        x, soft = mixing(x, y, step=global_step)
        loss = mixing.loss(model(x), soft)      # SoftTargetCrossEntropy (BCE for multi-label)

Label smoothing moves into the soft targets, so the loss itself does not smooth again.
timm draws its mixing weights and boxes from numpy's global generator, which torch's
seeding does not reach; each call here draws them from a generator seeded by
(seed, rank, step) instead, so a resumed run mixes exactly as the uninterrupted one, with
no state to save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from torchcls.config import DataConfig
from torchcls.errors import UserError


class Mixing:
    """`mixing(x, y) -> (x, soft_targets)`: x float (N, C, H, W), mixed in place as timm does;
    y int64 class indices (N,), or float (N, num_classes) 0/1 targets when `multilabel`;
    soft_targets float (N, num_classes), each row summing to 1 (multilabel: values in [0, 1])."""

    def __init__(self, num_classes: int, mixup: float = 0.0, cutmix: float = 0.0, label_smoothing: float = 0.0,
                 *, seed: int = 0, rank: int = 0, multilabel: bool = False):
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        _check_alphas(mixup, cutmix)
        if not 0.0 <= label_smoothing < 1.0:
            raise UserError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
        self.num_classes, self.seed, self.rank, self.calls = num_classes, seed, rank, 0
        self.mixup = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=label_smoothing,
                           num_classes=num_classes, multi_label=multilabel)
        self.loss: nn.Module = nn.BCEWithLogitsLoss() if multilabel else SoftTargetCrossEntropy()

    def __call__(self, x: torch.Tensor, y: torch.Tensor, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix a batch. `step` (the global training step) keys the random draws; without it a
        call counter does (saved by `state_dict`)."""
        key = self.calls if step is None else step
        self.calls += 1
        with _numpy_seeded(self.seed, self.rank, key):
            if len(x) % 2 == 0:
                return self.mixup(x, y)
            # timm pairs image i with image N-1-i, so it needs an even batch; an odd one (the last,
            # short batch of an epoch) mixes all but its last image, which keeps its own label.
            head_x, head_t = self.mixup(x[:-1], y[:-1]) if len(x) > 1 else (x[:0], self._targets(y[:0]))
            return torch.cat([head_x, x[-1:]]), torch.cat([head_t, self._targets(y[-1:])])

    def _targets(self, y: torch.Tensor) -> torch.Tensor:
        from timm.data.mixup import mixup_target

        m = self.mixup
        return mixup_target(y, self.num_classes, 1.0, m.label_smoothing, m.multi_label)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])


def build_mixing(cfg: DataConfig, label_smoothing: float, num_classes: int, batch_size: int, seed: int = 0,
                 rank: int = 0, multilabel: bool = False) -> Mixing | None:
    """The Mixing a training run needs, or None when --mixup and --cutmix are both 0.

    `batch_size`: images per step on this rank (the global batch over the world size)."""
    _check_alphas(cfg.mixup, cfg.cutmix)
    if cfg.mixup == 0 and cfg.cutmix == 0:
        return None
    flags = " ".join(f"--{n} {v}" for n, v in (("mixup", cfg.mixup), ("cutmix", cfg.cutmix)) if v)
    if batch_size % 2:
        raise UserError(f"{flags} pairs each image with another in its batch (timm's Mixup), so the batch per "
                        f"process must be even, got {batch_size}; use --batch-size {batch_size + 1} (or an even "
                        "multiple of the number of processes)")
    return Mixing(num_classes, cfg.mixup, cfg.cutmix, label_smoothing, seed=seed, rank=rank, multilabel=multilabel)


def _check_alphas(mixup: float, cutmix: float) -> None:
    for flag, alpha in (("--mixup", mixup), ("--cutmix", cutmix)):
        if not alpha >= 0.0:  # also refuses NaN
            raise UserError(f"{flag} is the alpha of a Beta(alpha, alpha) distribution and must be >= 0 "
                            f"(0 = off; timm's recipes use 0.8 for mixup, 1.0 for cutmix), got {alpha}")


@contextlib.contextmanager
def _numpy_seeded(seed: int, rank: int, key: int) -> Iterator[None]:
    """numpy's global generator seeded from (seed, rank, key) inside, restored after: other users
    of it are not disturbed."""
    saved = np.random.get_state()
    np.random.seed(np.random.SeedSequence([seed % 2**32, rank, key]).generate_state(1)[0])
    try:
        yield
    finally:
        np.random.set_state(saved)

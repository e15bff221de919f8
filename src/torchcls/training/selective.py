"""--selective-backprop F: from epoch N on (--selective-backprop-after-epochs), each batch is first scored by
a forward without gradients, and only the fraction F of its images with the highest loss go through the
forward and backward that train (Selective-Backprop: Jiang et al. 2019, "Accelerating Deep Learning by
Focusing on the Biggest Losers").

Why it pays on a CPU: a backward costs about twice its forward, so backpropagating half the batch costs
1 + 0.5 x 3 = 2.5 forwards' time against 4. The FastNet step of `fmnist-fast` ran 1.32x faster with F = 0.5
(bf16, 2-core AVX-512-bf16), and once the easy images are learnt (here after 2 epochs) they add little to the
gradient: docs/training.md has the measurements. The scoring forward also updates BatchNorm's running
statistics (it runs in training mode, as the model's batch statistics must be those of the whole batch's
images), so the running statistics see every image, the hard ones twice.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torchcls.config import OptimConfig


class SelectiveBackprop:
    def __init__(self, fraction: float, after_epochs: int):
        self.fraction, self.after_epochs = fraction, after_epochs

    def applies(self, epoch: int) -> bool:
        return epoch >= self.after_epochs

    def hardest(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Indices of the ceil(fraction x batch) images with the highest cross-entropy, hardest first."""
        losses = nn.functional.cross_entropy(logits.float(), targets, reduction="none")
        return losses.topk(min(len(targets), max(1, math.ceil(len(targets) * self.fraction)))).indices


def selective_backprop(cfg: OptimConfig) -> SelectiveBackprop | None:
    return SelectiveBackprop(cfg.selective_backprop, cfg.selective_backprop_after_epochs) \
        if cfg.selective_backprop else None

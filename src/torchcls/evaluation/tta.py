"""Test-time augmentation: class probabilities averaged over an image and its transforms.

Done outside the model, as separate forward passes, so that it works the same for an eager
model and for an exported artifact (whose batch limit each pass respects).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from torchcls.errors import UserError

TTA_MODES = ("none", "flip", "multicrop")


def check_tta(mode: str) -> str:
    if mode not in TTA_MODES:
        raise UserError(f"--tta must be one of {', '.join(TTA_MODES)}, got {mode!r}")
    return mode


def views(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The inputs a TTA mode runs the model on: flip = the batch and its horizontal mirror (last dim: W);
    multicrop = those two, then each of them translated by one pixel down-right and up-left (reflect-padded
    by 1 px, cropped back to the size: airbench's six views)."""
    mode = check_tta(mode)
    if mode == "none":
        return [x]
    if mode == "flip":
        return [x, x.flip(-1)]
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = [padded[..., :h, :w], padded[..., 2:, 2:]]  # content moved 1 px down-right, 1 px up-left
    return [x, x.flip(-1), *(v for s in shifted for v in (s, s.flip(-1)))]


def view_weights(mode: str) -> list[float]:
    """Each view's weight in the average: equal for flip; multicrop gives the untranslated pair half the
    weight and the four translated views the other half (airbench: 1/4, 1/4, then 1/8 each)."""
    n = len(views(torch.zeros(1, 1, 3, 3), mode))
    return [0.25, 0.25, 0.125, 0.125, 0.125, 0.125] if mode == "multicrop" else [1.0 / n] * n


def tta_probs(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str,
              multilabel: bool = False) -> torch.Tensor:
    """float32 class probabilities: the weighted mean over the views of each view's softmax (multilabel:
    sigmoid). (airbench averages the logits; the probabilities here keep multilabel and 'flip' as they were.)"""
    probs = torch.stack([_activate(model(v).float(), multilabel) for v in views(x, mode)])
    if mode != "multicrop":
        return probs.mean(dim=0)
    weights = torch.tensor(view_weights(mode), dtype=probs.dtype, device=probs.device)
    return (weights.view(-1, *([1] * (probs.dim() - 1))) * probs).sum(dim=0)


def _activate(logits: torch.Tensor, multilabel: bool) -> torch.Tensor:
    return logits.sigmoid() if multilabel else logits.softmax(dim=1)


def tta_logits(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str,
               multilabel: bool = False) -> torch.Tensor:
    """float32 scores whose softmax is `tta_probs` (log of the averaged probabilities; multilabel: their
    logit, whose sigmoid is `tta_probs`), so that metrics and the loss computed from logits describe the
    averaged prediction. With mode 'none' the model's own logits, unchanged."""
    if check_tta(mode) == "none":
        return model(x).float()
    if multilabel:
        return tta_probs(model, x, mode, True).clamp(1e-7, 1 - 1e-7).logit()
    return tta_probs(model, x, mode).clamp_min(torch.finfo(torch.float32).tiny).log()

"""Test-time augmentation: class probabilities averaged over an image and its transforms.

Done outside the model, as separate forward passes, so that it works the same for an eager
model and for an exported artifact (whose batch limit each pass respects).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchcls.errors import UserError

TTA_MODES = ("none", "flip")


def check_tta(mode: str) -> str:
    if mode not in TTA_MODES:
        raise UserError(f"--tta must be one of {', '.join(TTA_MODES)}, got {mode!r}")
    return mode


def views(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The inputs a TTA mode runs the model on: flip = the batch and its horizontal mirror (last dim: W)."""
    return [x] if check_tta(mode) == "none" else [x, x.flip(-1)]


def tta_probs(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str,
              multilabel: bool = False) -> torch.Tensor:
    """float32 class probabilities: the mean over the views of each view's softmax (multilabel: sigmoid)."""
    probs = [_activate(model(v).float(), multilabel) for v in views(x, mode)]
    return torch.stack(probs).mean(dim=0)


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

"""--class-weights auto: each class's cross-entropy term weighted inversely to its frequency in the
training split, weight_c = N / (C * count_c) (sklearn's "balanced": 1 for every class of a balanced
set). A class with no training image gets weight 0, with a warning: there is nothing to weigh.
"""

from __future__ import annotations

import torch

from torchcls.config import Config
from torchcls.console import console
from torchcls.errors import UserError


def train_class_counts(data) -> torch.Tensor:
    """Images per class in the training split of a DataBundle (or of a ShardBundle with an index)."""
    counts = getattr(data.train, "class_counts", None)  # WebDataset shards: from their index.json
    if counts is not None:
        return torch.as_tensor(counts, dtype=torch.float64)
    if not hasattr(data.train, "indices"):
        raise UserError("--class-weights auto needs the class counts of the training data; these shards have no "
                        "index.json with them: write them with `torchcls data shard`, or use --class-weights none")
    targets = data.images.targets[data.train.indices]
    if targets.ndim != 1:
        raise UserError("--class-weights auto weighs one label per image (--task multiclass); use --class-weights "
                        "none for multi-label data")
    return torch.bincount(targets.long(), minlength=len(data.classes)).double()


def class_weights(data) -> torch.Tensor | None:
    """weight_c = N / (C * count_c) as float32 (C,), 0 for a class absent from training; None without data."""
    counts = train_class_counts(data)
    if counts.sum() == 0:
        return None
    missing = [data.classes[i] for i in torch.nonzero(counts == 0).flatten().tolist()]
    if missing:
        console.print(f"[yellow]--class-weights auto: no training image of class(es) {', '.join(missing[:10])}; "
                      "their weight is 0[/]")
    weights = counts.sum() / (len(counts) * counts.clamp(min=1))
    return torch.where(counts > 0, weights, torch.zeros_like(weights)).float()


def loss_weights(cfg: Config, data, mixing, device: torch.device) -> torch.Tensor | None:
    """The cross-entropy's `weight` for this run (None: --class-weights none)."""
    if cfg.optim.class_weights != "auto":
        return None
    if mixing is not None or cfg.data.task != "multiclass":
        raise UserError("--class-weights auto weighs the hard-label cross-entropy of --task multiclass; with "
                        "--mixup/--cutmix or --task multilabel use --balanced-sampler instead, or --class-weights none")
    if cfg.data.balanced_sampler:
        raise UserError("--class-weights auto with --balanced-sampler corrects class frequencies twice; use one of "
                        "them")
    weights = class_weights(data)
    return weights.to(device) if weights is not None else None

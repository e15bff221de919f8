"""What changes with --task: the loss, the training accuracy, the validation metrics, the decision rule.

multiclass: one label per image; targets are int64 class indices (N,), softmax, cross-entropy, top-1.
multilabel: any number of labels per image; targets are float 0/1 vectors (N, classes) from a CSV
`labels` column, one sigmoid per class, binary cross-entropy, mAP (torchmetrics) as the best-model
criterion, and a per-label threshold chosen on the validation set (maximum F1) that evaluate,
predict, export and serve apply (default 0.5).

Label smoothing for multilabel is defined as timm's Mixup defines it for multi-label targets: each
0/1 target moves towards 0.5 by the smoothing (y * (1 - e) + e / 2), so the loss with and without
--mixup/--cutmix smooths the same way.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from torchcls.errors import UserError

MULTICLASS, MULTILABEL = "multiclass", "multilabel"
DEFAULT_THRESHOLD = 0.5


def is_multilabel_targets(targets: torch.Tensor) -> bool:
    """Float (N, classes) 0/1 vectors, as a CSV `labels` column gives them."""
    return targets.ndim == 2 and targets.is_floating_point()


def check_task(task: str, targets: torch.Tensor, where: str) -> None:
    """One clear message when the data's labels do not fit --task."""
    multilabel = is_multilabel_targets(targets)
    if task == MULTILABEL and not multilabel:
        raise UserError(f"--task multilabel: {where} has one label per image (no `labels` column). Multi-label "
                        "data is a CSV manifest with the columns path,labels (labels separated by ';', empty for "
                        "none); or train this data with --task multiclass")
    if task == MULTICLASS and multilabel:
        raise UserError(f"{where} has a `labels` column (any number of labels per image, separated by ';'): train "
                        "it with --task multilabel, or give one label per row in a `label` column")


def label_names(target: torch.Tensor, classes: list[str]) -> str:
    """A sample's label(s) as text: its class, or its labels joined by ';' (as a CSV `labels` cell)."""
    if target.ndim == 0:
        return classes[int(target)]
    return ";".join(c for c, on in zip(classes, target.tolist()) if on > 0.5)


def multilabel_targets(label_lists: list[list[str]], classes: list[str]) -> torch.Tensor:
    """float32 (N, classes) 0/1 rows from each sample's label names."""
    index = {c: i for i, c in enumerate(classes)}
    targets = torch.zeros(len(label_lists), len(classes), dtype=torch.float32)
    for row, labels in enumerate(label_lists):
        targets[row, [index[lbl] for lbl in labels]] = 1.0
    return targets


class SmoothedBCE(nn.Module):
    """BCE with logits against targets smoothed towards 0.5 (see the module note)."""

    def __init__(self, smoothing: float = 0.0):
        super().__init__()
        if not 0.0 <= smoothing < 1.0:
            raise UserError(f"--label-smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.bce = nn.BCEWithLogitsLoss()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.to(logits.dtype)
        if self.smoothing:
            targets = targets * (1.0 - self.smoothing) + 0.5 * self.smoothing
        return self.bce(logits, targets)


def multilabel_criterion(cfg: Any, data: Any, mixing: Any = None) -> nn.Module:
    """The multilabel loss of a run (cfg: the Config; data: its DataBundle). With mixing, its BCE on the
    already smoothed, mixed targets (--class-weights auto is refused for multilabel by class_weights.py)."""
    images = getattr(data, "images", None)
    targets = getattr(images, "targets", None)
    if not isinstance(targets, torch.Tensor):
        raise UserError("--task multilabel needs a CSV manifest with a `labels` column (not WebDataset shards)")
    check_task(MULTILABEL, targets, getattr(images, "origin", "") or cfg.data.source)
    if cfg.model.name.startswith("ee/"):
        raise UserError(f"--model {cfg.model.name}: early-exit models leave at a softmax confidence, which a "
                        "multi-label model does not have; use the plain model with --task multilabel")
    return mixing.loss if mixing is not None else SmoothedBCE(cfg.optim.label_smoothing)


def train_correct(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Correct decisions of a training batch as a device scalar (no host sync): multiclass the top-1
    hits, multilabel the per-label accuracy at logit 0 (probability 0.5) summed over the images."""
    if is_multilabel_targets(y):
        return ((logits.detach() > 0) == (y > 0.5)).float().mean(dim=1).sum()
    return (logits.argmax(1) == y).sum()


def best_score(record: dict[str, Any]) -> float:
    """What picks best.safetensors: validation mAP (multilabel), else validation top-1, else training's."""
    for key in ("val_map", "val_top1", "train_top1"):
        if key in record:
            return record[key]
    raise KeyError("the epoch record holds no score")


# -- multilabel metrics and thresholds -------------------------------------------------------
def best_f1_thresholds(probs: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Per label, the probability threshold that maximises F1 on (probs, targets), halfway between the
    lowest score kept positive and the next one; 0.5 for a label without positives (F1 undefined)."""
    thresholds = []
    for k in range(probs.shape[1]):
        p, t = probs[:, k].double(), targets[:, k] > 0.5
        positives = int(t.sum())
        if positives == 0:
            thresholds.append(DEFAULT_THRESHOLD)
            continue
        order = torch.argsort(p, descending=True, stable=True)
        p, t = p[order], t[order]
        tp = t.cumsum(0).double()
        f1 = 2 * tp / (torch.arange(1, len(p) + 1, dtype=torch.float64) + positives)
        distinct = torch.ones(len(p), dtype=torch.bool)  # cut only between different scores
        distinct[:-1] = p[:-1] != p[1:]
        i = int(torch.where(distinct, f1, torch.full_like(f1, -1.0)).argmax())
        below = float(p[i + 1]) if i + 1 < len(p) else 0.0
        thresholds.append(round((float(p[i]) + below) / 2, 6))
    return thresholds


def multilabel_metrics(logits: torch.Tensor, targets: torch.Tensor, classes: list[str],
                       thresholds: list[float] | None = None) -> dict[str, Any]:
    """torchmetrics multilabel figures: mAP (macro average precision over labels with positives), F1 per
    label at 0.5 and at `thresholds` (chosen on these data when None), exact-match accuracy (every label
    right, at `thresholds`), BCE loss."""
    from torchmetrics.functional.classification import (
        multilabel_average_precision,
        multilabel_exact_match,
        multilabel_f1_score,
    )

    k = len(classes)
    logits, targets = logits.float().cpu(), targets.float().cpu()
    probs, truth = logits.sigmoid(), targets.round().long()
    with warnings.catch_warnings():  # a label without positives: its AP is set to NaN below
        warnings.simplefilter("ignore", UserWarning)
        ap = multilabel_average_precision(probs, truth, num_labels=k, average="none", thresholds=None)
    support = truth.sum(0)
    ap = torch.where(support > 0, ap, torch.full_like(ap, float("nan")))  # no positive: AP undefined
    f1_half = multilabel_f1_score(probs, truth, num_labels=k, threshold=DEFAULT_THRESHOLD, average="none")
    chosen = thresholds if thresholds is not None else best_f1_thresholds(probs, targets)
    tuned = probs >= torch.tensor(chosen)  # per-label thresholds: F1 from the decisions themselves
    f1_tuned = multilabel_f1_score(tuned.float(), truth, num_labels=k, threshold=0.5, average="none")
    valid = ~ap.isnan()
    return {
        "map": ap[valid].mean().item() if valid.any() else float("nan"),
        "f1": f1_half.mean().item(),
        "f1_tuned": f1_tuned.mean().item(),
        "exact_match": multilabel_exact_match(tuned.float(), truth, num_labels=k, threshold=0.5).item(),
        "loss": nn.functional.binary_cross_entropy_with_logits(logits, targets).item(),
        "n": len(targets),
        "thresholds": [float(t) for t in chosen],
        "per_label": {c: {"ap": None if ap[i].isnan() else ap[i].item(), "f1": f1_half[i].item(),
                          "f1_at_threshold": f1_tuned[i].item(), "threshold": float(chosen[i]),
                          "support": int(support[i])} for i, c in enumerate(classes)},
    }


def validation_record(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """The val_* keys of a multilabel epoch record (metrics.jsonl); val_thresholds travel into the
    checkpoint metadata."""
    m = multilabel_metrics(logits, targets, [str(i) for i in range(logits.shape[1])])
    return {"val_loss": m["loss"], "val_map": m["map"], "val_f1": m["f1"], "val_f1_tuned": m["f1_tuned"],
            "val_exact_match": m["exact_match"], "val_thresholds": m["thresholds"]}


# -- decisions at inference ------------------------------------------------------------------
def thresholds_for(meta: Any) -> list[float]:
    """The per-label thresholds a checkpoint or artifact carries; 0.5 for each label when it has none."""
    saved = getattr(meta, "thresholds", None)
    return list(saved) if saved else [DEFAULT_THRESHOLD] * len(meta.classes)


def labels_above(probs: list[float], thresholds: list[float], classes: list[str]) -> list[dict[str, Any]]:
    """Every label whose probability reaches its threshold, most probable first."""
    hits = [(p, c) for p, t, c in zip(probs, thresholds, classes) if p >= t]
    return [{"label": c, "prob": round(p, 6)} for p, c in sorted(hits, key=lambda h: -h[0])]

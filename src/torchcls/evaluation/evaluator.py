"""Evaluate a checkpoint: top-1/top-5, per-class precision/recall/F1, confusion matrix (up to
CONFUSION_MAX_CLASSES classes) and calibration error (torchmetrics), written to eval.json plus a
confusion-matrix PNG.
Multilabel checkpoints (--task multilabel): mAP, F1 and AP per label, exact match, and the decision
thresholds the checkpoint carries (torchcls.tasks).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from torchcls.checkpoint.files import load_model, output_dir_of, resolve_checkpoint
from torchcls.config import Config, DataConfig
from torchcls.data import eval_dataset, make_loader, read_skips
from torchcls.data.skips import skip_log_path
from torchcls.data.splits import available_splits
from torchcls.devices import resolve_device
from torchcls.errors import UserError
from torchcls.evaluation.tta import check_tta, tta_logits
from torchcls.events import EvaluationWritten, publish
from torchcls.options import EvaluateOptions as _D  # the defaults, declared once
from torchcls.run_files import write_text_atomic
from torchcls.tasks import MULTILABEL, check_task, multilabel_metrics, thresholds_for

SPLITS = ("val", "test", "train", "all")
# A k x k confusion matrix costs k**2 int64 to compute (torchmetrics), to list in eval.json and to draw: at a
# checkpoint's bound of 100,000 classes that was 80 GB. 1,000 classes (ImageNet-1k) is 8 MB and ~12 MB of JSON;
# past it the matrix is left out, and eval.json says so (`confusion_matrix_omitted`); every other metric stays.
CONFUSION_MAX_CLASSES = 1000


@torch.no_grad()
def predict_logits(model: torch.nn.Module, loader, device: torch.device,
                   tta: str = "none", multilabel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets over `loader`; with `tta` the log (multilabel: logit) of the TTA-averaged probabilities."""
    model.to(device).eval()
    logits, targets = [], []
    for x, y in loader:
        logits.append(tta_logits(model, x.to(device), tta, multilabel).cpu())
        targets.append(y)
    return torch.cat(logits), torch.cat(targets)


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor, classes: list[str]) -> dict[str, Any]:
    from torchmetrics.classification import (
        MulticlassAccuracy,
        MulticlassCalibrationError,
        MulticlassConfusionMatrix,
        MulticlassF1Score,
        MulticlassPrecision,
        MulticlassRecall,
    )

    k = len(classes)
    probs = logits.softmax(dim=1)
    top1 = MulticlassAccuracy(k, top_k=1, average="micro")(probs, targets).item()
    top5 = MulticlassAccuracy(k, top_k=min(5, k), average="micro")(probs, targets).item()
    per_class = {name: MetricCls(k, average="none")(probs, targets) for name, MetricCls in
                 (("precision", MulticlassPrecision), ("recall", MulticlassRecall), ("f1", MulticlassF1Score))}
    support = torch.bincount(targets, minlength=k)
    return {
        "top1": top1,
        "top5": top5,
        "n": len(targets),
        "loss": torch.nn.functional.cross_entropy(logits, targets).item(),
        "ece": MulticlassCalibrationError(k, n_bins=15, norm="l1")(probs, targets).item(),
        "macro_f1": per_class["f1"].mean().item(),
        "per_class": {c: {"precision": per_class["precision"][i].item(), "recall": per_class["recall"][i].item(),
                          "f1": per_class["f1"][i].item(), "support": int(support[i])} for i, c in enumerate(classes)},
        "classes": classes,
        **_confusion(k, probs, targets, MulticlassConfusionMatrix),
    }


def _confusion(k: int, probs: torch.Tensor, targets: torch.Tensor, metric) -> dict[str, Any]:
    """{"confusion_matrix": k x k counts}, or past CONFUSION_MAX_CLASSES a record that it was left out."""
    if k > CONFUSION_MAX_CLASSES:
        return {"confusion_matrix_omitted": {
            "classes": k, "max_classes": CONFUSION_MAX_CLASSES,
            "reason": f"{k:,} classes: a {k:,} x {k:,} matrix is too large to compute, store or draw "
                      f"(left out past {CONFUSION_MAX_CLASSES:,} classes)"}}
    return {"confusion_matrix": metric(k)(probs, targets).tolist()}


def evaluate(checkpoint: str | Path, data: str | None = None, root: str | None = None, split: str | None = None,
             out_dir: str | Path | None = None, batch_size: int = _D.batch_size, workers: int = _D.workers,
             device: str = _D.device, on_bad_file: str = _D.on_bad_file, threshold: float | None = None,
             target_accuracy: float | None = None, target_compute: float | None = None,
             tta: str = _D.tta) -> dict[str, Any]:
    """Evaluate `checkpoint` (a .safetensors file or a run dir) and write eval.json + confusion.png.

    By default it evaluates on the data it was trained with: the official test split
    where the set has one, else the seeded held-out (val) split. Results go to the run
    dir of the checkpoint, or `out_dir`.
    """
    check_tta(tta)  # before any loading: a typo costs nothing
    path = resolve_checkpoint(checkpoint)
    model, meta = load_model(path)
    train_cfg = Config.recorded(meta.config, origin=f"{path} metadata")
    train_data: DataConfig = replace(train_cfg.data, on_bad_file=on_bad_file)  # early exits calibrate on it
    data_cfg = train_data
    if data is not None:  # other data: the training run's --val-data does not apply to it
        data_cfg = replace(data_cfg, source=data, root=root, val_data=None)
    elif root is not None:
        data_cfg = replace(data_cfg, root=root)
    split = split or ("test" if data_cfg.source == "fashion-mnist" else "val")
    if split not in SPLITS:
        raise UserError(f"--split {split}: choose one of {', '.join(SPLITS)}")
    if data is not None and split == "val" and "val" not in available_splits(data):
        split = "all"  # other data than the training data, without a val split of its own: use all of it
    dataset, images = eval_dataset(data_cfg, meta.preprocess, split, train_cfg.train.seed)
    check_task(meta.task, images.targets, images.origin or data_cfg.source)
    dataset = _align_classes(dataset, images, meta.classes, data_cfg.source)
    loader = make_loader(dataset, batch_size, workers, shuffle=False)
    exits = _early_exit_setup(model, meta, train_data, train_cfg.train.seed, resolve_device(device), batch_size,
                              workers, threshold, target_accuracy, target_compute)

    with tempfile.TemporaryDirectory(prefix="torchcls-eval-") as tmp:  # files skipped while decoding
        dataset.skip_log = skip_log_path(tmp)
        logits, targets = predict_logits(model, loader, resolve_device(device), tta, meta.task == MULTILABEL)
        skipped = images.skipped + [(d["file"], d["reason"]) for d in read_skips(tmp)]
    metrics = multilabel_metrics(logits, targets, meta.classes, thresholds_for(meta)) if meta.task == MULTILABEL \
        else classification_metrics(logits, targets, meta.classes)
    result = {"checkpoint": str(path), "data": data_cfg.source, "split": split, "tta": tta, "task": meta.task,
              **metrics}
    if split in ("val", "train") and data_cfg.val_data:  # the recorded --val-data chose these images: say which
        result["val_data"] = data_cfg.val_data
    if skipped:
        result["skipped_files"] = [{"file": f, "reason": r} for f, r in skipped]

    out = Path(out_dir) if out_dir else output_dir_of(path)
    out.mkdir(parents=True, exist_ok=True)
    if exits is not None:  # early-exit models: exits taken, FLOPs, latency, accuracy-vs-compute curve
        from torchcls.evaluation.exit_sweep import exit_report

        result["early_exit"] = exit_report(model, loader, resolve_device(device), _image_shape(meta), exits)
    if meta.task != MULTILABEL:  # the report's gallery of the errors the model was surest of
        from torchcls.evaluation.worst_errors import worst_errors

        result["misclassified"] = worst_errors(logits, targets, dataset, meta.classes, out)
    write_text_atomic(out / "eval.json", json.dumps(result, indent=2))
    publish(EvaluationWritten(out, result, list(meta.classes)))  # the report draws its figures, refreshes report.html
    result["out_dir"] = str(out)
    return result


def _early_exit_setup(model, meta, data_cfg: DataConfig, seed: int, device, batch_size: int, workers: int,
                      threshold, target_accuracy, target_compute) -> dict[str, Any] | None:
    """Early-exit models: set the threshold, or calibrate it on the validation split.
    Returns the calibration record ({} when none); None for plain models."""
    from torchcls.models.early_exit import EarlyExitNet, check_threshold

    if not isinstance(model, EarlyExitNet):
        if threshold is not None or target_accuracy is not None or target_compute is not None:
            raise UserError(f"--threshold/--target-accuracy/--target-compute apply to early-exit models "
                            f"(ee/...), not to '{meta.spec.name}'")
        return None
    if threshold is not None:
        if target_accuracy is not None or target_compute is not None:
            raise UserError("give either --threshold or a calibration target, not both")
        model.threshold = check_threshold(threshold)
        return {}
    if target_accuracy is None and target_compute is None:
        return {}
    from torchcls.evaluation.exit_sweep import calibrate_on

    val, _ = eval_dataset(data_cfg, meta.preprocess, "val", seed)  # the training data's held-out part
    if len(val) == 0:
        raise UserError(f"calibration needs the validation split of {data_cfg.source}, but it is empty "
                        "(trained with --val-fraction 0); pass --threshold instead")
    return calibrate_on(model, make_loader(val, batch_size, workers, shuffle=False), device, _image_shape(meta),
                        target_accuracy, target_compute)


def _image_shape(meta) -> tuple[int, int, int]:
    return (meta.preprocess.channels, meta.preprocess.img_size, meta.preprocess.img_size)


def _align_classes(dataset, images, model_classes: list[str], source: str):
    """Map the data's class names onto the model's class indices; unknown labels are an error."""
    if images.classes == model_classes:
        return dataset
    unknown = sorted(set(images.classes) - set(model_classes))
    if unknown:
        raise UserError(f"{source}: label(s) {', '.join(unknown)} are not classes of this model "
                        f"(it knows: {', '.join(model_classes)})")
    index = {c: model_classes.index(c) for c in images.classes}
    if images.targets.ndim == 2:  # multi-label: move each column to the model's class
        aligned = torch.zeros(len(images.targets), len(model_classes))
        aligned[:, [index[c] for c in images.classes]] = images.targets
        images.targets, images.classes = aligned, list(model_classes)
        return dataset
    images.targets = torch.tensor([index[images.classes[t]] for t in images.targets.tolist()])
    images.classes = list(model_classes)
    return dataset

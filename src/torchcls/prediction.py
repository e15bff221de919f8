"""Predict: image files or folders → top-k labels with probabilities."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchcls.artifacts.artifact import load_artifact
from torchcls.artifacts.eager_auto import eager_model
from torchcls.artifacts.targets import BY_SUFFIX
from torchcls.checkpoint.files import load_model
from torchcls.data import build_transform
from torchcls.data.images import BadImage, load_image
from torchcls.data.scan import list_files
from torchcls.devices import resolve_device
from torchcls.errors import UserError
from torchcls.evaluation.tta import check_tta, tta_probs
from torchcls.options import PredictOptions as _D  # the defaults (and ranges), declared once
from torchcls.options import check_values
from torchcls.tasks import MULTILABEL, labels_above, thresholds_for

ARTIFACT_SUFFIXES = tuple(BY_SUFFIX)  # .pt2, .onnx, .pte: exported artifacts, run on their own runtime


@dataclass
class Predictions:
    items: list[dict[str, Any]]  # {"file", "top": [{"label", "prob"}, ...]} (+ "labels" above threshold: multilabel)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"file", "reason"}
    precision: str = ""  # a checkpoint: what --precision chose and why (the line logged on stderr)


def expand_inputs(inputs: list[str | Path]) -> list[Path]:
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():  # broken symlinks and unreadable entries stay in, so that they are reported
            listing = list_files(item)
            found = sorted(listing.files + [Path(p) for p, _ in listing.problems])
            if not found:
                raise UserError(f"folder {item} holds no files")
            files += found
        elif item.is_file() or item.is_symlink():  # a broken symlink is reported by load_image
            files.append(item)
        else:
            raise UserError(f"{item} does not exist")
    if not files:
        raise UserError("no input images given")
    return files


@torch.no_grad()
def predict(checkpoint: str | Path, inputs: list[str | Path], topk: int = _D.topk, device: str = _D.device,
            on_bad_file: str = _D.on_bad_file, batch_size: int = 64,
            expect_sha256: str | None = _D.expect_sha256, tta: str = _D.tta,
            trust_artifact: bool = _D.trust_artifact, precision: str = _D.precision) -> Predictions:
    """Top-k labels for each image; `tta="flip"` averages the softmax of each image and its mirror.
    Multilabel models: probabilities are sigmoids, and "labels" lists every label at or above its threshold.
    `precision`: what a checkpoint runs in (auto = bf16 where the hardware computes it natively, else fp32)."""
    from torchcls.provenance.sidecars import check_pinned_sha256, refuse_forbidden_predictions

    check_tta(tta)
    check_values(_D, "predict", topk=topk)  # topk 0 took no label and -2 a torch error; the CLI checked it too
    if batch_size < 1:
        raise UserError(f"batch size {batch_size}: give the number of images per inference batch, >= 1")
    refuse_forbidden_predictions(checkpoint, "predict")  # a policy's [outputs] predictions = false
    if Path(checkpoint).suffix in ARTIFACT_SUFFIXES:  # .pt2/.onnx/.pte run on their own runtime
        # Host batches in: the artifact moves them to its device (pinned copy) and returns host logits.
        model = load_artifact(checkpoint, expect_sha256=expect_sha256, device=device, trust=trust_artifact,
                              precision=precision)
        meta, dev, batch_size = model.info, torch.device("cpu"), min(batch_size, model.info.max_batch)
        precision_line = ""  # fixed at export; the artifact says it in its info
    else:
        check_pinned_sha256(checkpoint, expect_sha256)
        model, meta = load_model(checkpoint)
        dev = resolve_device(device)
        # auto: bf16 only where it agrees with fp32 on held-out images, checked once per checkpoint and machine.
        model, choice = eager_model(model, meta, precision, dev)
        precision_line = choice.line()
        print(f"torchcls predict: {precision_line}", file=sys.stderr)  # stderr: --json output stays parseable
    transform = build_transform(meta.preprocess, train=False)
    result = Predictions([], precision=precision_line)
    k = min(topk, len(meta.classes))
    multilabel = meta.task == MULTILABEL  # sigmoid per class; every label above its threshold

    def run(chunk: list[tuple[Path, torch.Tensor]]) -> None:
        probs = tta_probs(model, torch.stack([t for _, t in chunk]).to(dev), tta, multilabel).cpu()
        values, indices = probs.topk(k, dim=1)
        for (f, _), p, vals, idx in zip(chunk, probs, values, indices):
            item = {"file": str(f), "top": [{"label": meta.classes[i], "prob": round(v, 6)}
                                            for v, i in zip(vals.tolist(), idx.tolist())]}
            if multilabel:
                item["labels"] = labels_above(p.tolist(), thresholds_for(meta), meta.classes)
            result.items.append(item)

    # Decoded a batch at a time: at most batch_size transformed images are held (each is 4 x C x H x W bytes,
    # 602 KB at 224 px whatever the file's size), never one per input file.
    chunk: list[tuple[Path, torch.Tensor]] = []
    for f in expand_inputs(inputs):
        try:
            chunk.append((f, transform(load_image(f, meta.preprocess.channels, meta.preprocess.resize_size))))
        except BadImage as e:
            if on_bad_file == "error":
                raise UserError(f"{f}: {e} (pass --on-bad-file skip to leave it out)") from None
            result.skipped.append({"file": str(f), "reason": str(e)})
        if len(chunk) == batch_size:
            run(chunk)
            chunk = []
    if chunk:
        run(chunk)
    return result

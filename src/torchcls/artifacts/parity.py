"""Parity of an artifact against the eager fp32 model on held-out images of the checkpoint's own data.

`compare` is the one parity function of torchcls (export, inference quantization, benchmarks): it takes
two logit tensors, so it is light to import and knows nothing of artifacts.

The numbers (max |Δlogit|, top-1 agreement, n, and both accuracies) go to parity.json beside the
artifact; an artifact below the agreement threshold is never called finished.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from torchcls.errors import UserError

if TYPE_CHECKING:  # light to import: compare() is used by quantization and the benchmarks
    from torchcls.checkpoint.files import CheckpointMeta

DEFAULT_MIN_AGREEMENT = {"fp32": 0.999, "bf16": 0.99}


class RunsBatches(Protocol):
    """What measure_parity needs of a LoadedArtifact (artifacts/targets/base.py), named by its shape:
    the targets import this module (int8 calibration), so naming the class would close a circle."""

    info: Any  # its ArtifactInfo: max_batch

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def held_out_images(meta: CheckpointMeta, limit: int, data: str | None = None,
                    root: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `limit` images, evenly spread over the held-out split the checkpoint was validated on
    (the official test split for fashion-mnist), preprocessed exactly as at evaluation."""
    from torchcls.config import Config
    from torchcls.data import eval_dataset

    cfg = Config.recorded(meta.config, origin="checkpoint metadata")
    data_cfg = cfg.data
    if data is not None:
        data_cfg = replace(data_cfg, source=data, root=root)
    elif root is not None:
        data_cfg = replace(data_cfg, root=root)
    split = "test" if data_cfg.source == "fashion-mnist" else ("all" if data is not None else "val")
    try:
        dataset, _ = eval_dataset(data_cfg, meta.preprocess, split, cfg.train.seed)
    except UserError as e:
        raise UserError(f"parity needs held-out images of the checkpoint's data: {e} (pass --data to use other "
                        "images of the same classes)") from None
    picks = torch.linspace(0, len(dataset) - 1, min(limit, len(dataset))).round().long().unique()
    items = [dataset[int(i)] for i in picks]
    ys = [y for _, y in items]  # class indices, or multi-label 0/1 rows
    return torch.stack([x for x, _ in items]), torch.stack(ys) if isinstance(ys[0], torch.Tensor) else torch.tensor(ys)


def compare(reference: torch.Tensor, candidate: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
    """Parity figures of `candidate` logits against `reference` logits for the same images: max and mean
    |Δlogit|, top-1 agreement, n, and both accuracies when `labels` are given. The only parity function:
    export, quantization and the benchmarks all report these keys."""
    if reference.shape != candidate.shape or reference.ndim != 2 or len(reference) == 0:
        raise UserError(f"parity compares two (N, classes) logit tensors with N >= 1; got {tuple(reference.shape)} "
                        f"and {tuple(candidate.shape)}")
    ref, out = reference.detach().float().cpu(), candidate.detach().float().cpu()
    diff = (ref - out).abs()
    result: dict[str, Any] = {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "top1_agreement": (ref.argmax(1) == out.argmax(1)).float().mean().item(),
        "n": len(ref),
    }
    if labels is not None and labels.ndim == 2:  # multi-label: per-label accuracy at probability 0.5
        labels = labels.cpu() > 0.5
        result["eager_accuracy"] = ((ref > 0) == labels).float().mean().item()
        result["artifact_accuracy"] = ((out > 0) == labels).float().mean().item()
    elif labels is not None:
        labels = labels.cpu()
        result["eager_accuracy"] = (ref.argmax(1) == labels).float().mean().item()
        result["artifact_accuracy"] = (out.argmax(1) == labels).float().mean().item()
    return result


SINGLE_IMAGES = 16  # parity images run one at a time, through an artifact's batch-1 path


@torch.inference_mode()
def measure_parity(eager: nn.Module, artifact: RunsBatches, images: torch.Tensor, labels: torch.Tensor,
                   min_agreement: float) -> dict[str, Any]:
    """Run both on the first SINGLE_IMAGES images one at a time (artifacts with a model of their own for batch 1,
    a .pt2's and OpenVINO's, are held to the bound there too), then on the rest in chunks that end with a
    partial one (the dynamic batch dimension is exercised too)."""
    chunk = max(1, min(artifact.info.max_batch, 32))
    singles = min(SINGLE_IMAGES, len(images))
    rest = images[singles:].split(chunk) if len(images) > singles else ()  # (an empty tensor splits into itself)
    ref, out = [], []
    for x in (*images[:singles].split(1), *rest):
        ref.append(eager(x).float())
        out.append(artifact(x))
    result = compare(torch.cat(ref), torch.cat(out), labels)
    return result | {"batch1_images": singles, "min_agreement": min_agreement,
                     "passed": result["top1_agreement"] >= min_agreement}


AUTO_CHECK_IMAGES = 200  # held-out images auto checks a reduced-precision eager model on (eager_auto: serve, predict)

"""Validation during training: one function for one process and for every rank of a torchrun job."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchcls.precision.training import PrecisionPlan
from torchcls.tasks import is_multilabel_targets, validation_record
from torchcls.training.distributed import Session, sync_buffers


@torch.no_grad()
def validate(model: nn.Module, loader, own: int, device: torch.device, precision: PrecisionPlan,
             memory_format: torch.memory_format, session: Session) -> dict[str, float]:
    """Held-out loss/top-1/top-5 over all ranks (one process: a world of 1).

    `own`: how many of the images this rank reads are its own. The map-style and in-memory feeds
    give rank r positions r, r+W, r+2W, ... of the held-out set, wrapped around at the end so that
    all ranks run equally many batches; the wrapped duplicates (the tail of the last batch) are
    left out. Sums are reduced so every rank reports the same numbers."""
    sync_buffers(model, session)  # every rank evaluates (and later saves) the same BN statistics
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, n: read once at the end
    offset, multilabel, outputs = 0, False, []  # multilabel: (logits, targets) per batch; mAP needs them all
    for x, y in loader:
        x, y = x.to(device, memory_format=memory_format), y.to(device)
        with precision.autocast():
            logits = model(x).float()  # every rank runs every batch: FSDP2 gathers weights collectively
        multilabel = multilabel or is_multilabel_targets(y)
        keep = max(0, min(len(y), own - offset))
        offset += len(y)
        if keep == 0:
            continue
        logits, y = logits[:keep], y[:keep]
        if multilabel:
            outputs.append((logits, y))
            continue
        topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
        sums += torch.stack([nn.functional.cross_entropy(logits, y, reduction="sum").double(),
                             (topk[:, 0] == y).sum().double(), (topk == y[:, None]).any(dim=1).sum().double(),
                             torch.tensor(float(keep), dtype=torch.float64, device=device)])
    model.train()
    if multilabel:
        return _multilabel_record(outputs, logits.shape[1], session)
    sums = sums.cpu()
    if session.active:
        dist.all_reduce(sums)
    loss, top1, top5, n = sums.tolist()
    return {"val_loss": loss / n, "val_top1": top1 / n, "val_top5": top5 / n}


def _multilabel_record(batches: list[tuple[torch.Tensor, torch.Tensor]], k: int, session: Session) -> dict[str, float]:
    """mAP, F1 and thresholds over the whole validation set: every rank's outputs are gathered (a ranking
    metric cannot be summed per rank), so every rank reports the same numbers."""
    logits = torch.cat([b[0].cpu() for b in batches] or [torch.zeros(0, k)])
    targets = torch.cat([b[1].float().cpu() for b in batches] or [torch.zeros(0, k)])
    if session.active:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (logits, targets))
        logits, targets = torch.cat([g[0] for g in gathered]), torch.cat([g[1] for g in gathered])
    return validation_record(logits, targets)

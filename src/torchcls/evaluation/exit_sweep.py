"""Early-exit evaluation: exit statistics, FLOPs and latency per sample, threshold calibration.

The sweep runs every exit on every sample once ([exits, N, classes] logits) and then
replays the exit rule for any threshold without touching the model again: the sample
leaves at the first exit whose confidence reaches the threshold, exactly what the
eager model does. FLOPs per exit path come from torch.utils.flop_counter on one image.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from torchcls.errors import UserError
from torchcls.models.early_exit import EarlyExitNet, check_threshold

GRID = [round(0.5 + i * 0.01, 2) for i in range(50)] + [0.995, 0.999, 0.9999, 1.0]  # thresholds swept


@dataclass
class ExitCosts:
    path_flops: list[float]  # per image: FLOPs of leaving at exit k (segments and heads 0..k)
    backbone_flops: float  # per image: the backbone alone, no exit heads


@dataclass
class SweepPoint:
    threshold: float
    accuracy: float
    mean_flops: float
    relative_compute: float  # mean_flops / backbone_flops
    exit_fractions: list[float]


def exit_costs(model: EarlyExitNet, image_shape: tuple[int, int, int]) -> ExitCosts:
    from torch.utils.flop_counter import FlopCounterMode

    def count(module, x):
        with FlopCounterMode(display=False) as counter:
            y = module(x)
        return counter.get_total_flops(), y

    path, total, h = [], 0.0, torch.zeros(1, *image_shape, device=_device(model))
    with torch.no_grad():
        seg_total = 0.0
        for segment, head in zip(model.segments, model.heads):
            seg, h = count(segment, h)
            head_flops, _ = count(head, h)
            seg_total += seg
            total += seg + head_flops
            path.append(float(total))
    return ExitCosts(path, float(seg_total + head_flops))


@torch.no_grad()
def all_exit_logits(model: EarlyExitNet, loader, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every exit's logits for every sample: ([exits, N, classes], targets)."""
    model.to(device).eval()
    outs, targets = [], []
    for x, y in loader:
        outs.append(torch.stack(model.all_exits(x.to(device))).float().cpu())
        targets.append(y)
    return torch.cat(outs, dim=1), torch.cat(targets)


def simulate(logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """The exit index each sample takes at `threshold` (the eager rule, replayed)."""
    conf = logits.softmax(dim=2).amax(dim=2)  # [exits, N]
    leaves = conf >= threshold
    leaves[-1] = True  # the last exit always answers
    return leaves.int().argmax(dim=0)  # first exit that leaves


def sweep_point(logits: torch.Tensor, targets: torch.Tensor, costs: ExitCosts, threshold: float) -> SweepPoint:
    index = simulate(logits, threshold)
    preds = logits[index, torch.arange(logits.shape[1])].argmax(dim=1)
    fractions = torch.bincount(index, minlength=logits.shape[0]).float() / len(index)
    mean_flops = float((fractions * torch.tensor(costs.path_flops)).sum())
    return SweepPoint(threshold, float((preds == targets).float().mean()), mean_flops,
                      mean_flops / costs.backbone_flops, fractions.tolist())


def sweep(logits: torch.Tensor, targets: torch.Tensor, costs: ExitCosts, grid=GRID) -> list[SweepPoint]:
    return [sweep_point(logits, targets, costs, t) for t in grid]


def calibrate(points: list[SweepPoint], target_accuracy: float | None = None,
              target_compute: float | None = None) -> SweepPoint:
    """The threshold for a target: the cheapest one reaching `target_accuracy`, or the most
    accurate one within `target_compute` (mean FLOPs as a fraction of the backbone's). A target that no
    threshold meets gets the nearest one instead: the most accurate (then cheapest), or the cheapest;
    calibrate_on says so (see `reached`)."""
    if (target_accuracy is None) == (target_compute is None):
        raise UserError("give exactly one calibration target: --target-accuracy or --target-compute")
    if target_accuracy is not None:
        if not 0.0 <= target_accuracy <= 1.0:
            raise UserError(f"--target-accuracy {target_accuracy} is outside [0, 1] (e.g. 0.9 for 90%)")
        ok = [p for p in points if p.accuracy >= target_accuracy]
        if not ok:
            return max(points, key=lambda p: (p.accuracy, -p.mean_flops))
        return min(ok, key=lambda p: (p.mean_flops, -p.accuracy))
    if not 0.0 < target_compute <= 1.5:
        raise UserError(f"--target-compute {target_compute}: give the mean compute as a fraction of the "
                        "backbone's, e.g. 0.7 for 70%")
    ok = [p for p in points if p.relative_compute <= target_compute]
    if not ok:
        return min(points, key=lambda p: (p.relative_compute, -p.accuracy))
    return max(ok, key=lambda p: (p.accuracy, -p.mean_flops))


def reached(point: SweepPoint, target_accuracy: float | None, target_compute: float | None) -> bool:
    return point.accuracy >= target_accuracy if target_accuracy is not None else \
        point.relative_compute <= target_compute


@torch.no_grad()
def latency_per_sample(model: EarlyExitNet, images: torch.Tensor, backbone_only: bool = False) -> float:
    """Mean milliseconds per image at batch 1 (eager; after one warm-up image)."""
    model.eval()
    last = model.num_exits - 1
    run = (lambda x: model.exit_logits(x, last)) if backbone_only else model
    run(images[:1])
    t0 = time.perf_counter()
    for i in range(len(images)):
        run(images[i:i + 1])
    return (time.perf_counter() - t0) * 1000 / len(images)


def exit_report(model: EarlyExitNet, loader, device: torch.device, image_shape,
                calibration: dict[str, Any] | None = None, latency_images: int = 200) -> dict[str, Any]:
    """eval.json's `early_exit` section (the report draws its exit_curve.png: report/subscriber.py)."""
    logits, targets = all_exit_logits(model, loader, device)
    costs = exit_costs(model, image_shape)
    points = sweep(logits, targets, costs, sorted(set(GRID) | {model.threshold}))
    here = sweep_point(logits, targets, costs, model.threshold)
    images = torch.cat([x for x, _ in _take(loader, latency_images)])[:latency_images].to(device)
    result = {
        "threshold": model.threshold, "exits": model.num_exits, "accuracy": here.accuracy,
        "exit_fractions": here.exit_fractions, "mean_flops": here.mean_flops,
        "backbone_flops": costs.backbone_flops, "relative_compute": here.relative_compute,
        "exit_path_flops": costs.path_flops, "backbone_accuracy": sweep_point(logits, targets, costs, 2.0).accuracy,
        "latency_ms_per_sample": latency_per_sample(model, images),
        "backbone_latency_ms_per_sample": latency_per_sample(model, images, backbone_only=True),
        "latency_images": len(images), "curve": [asdict(p) for p in points],
    }
    if calibration:
        result["calibration"] = calibration
    return result


def calibrate_on(model: EarlyExitNet, loader, device: torch.device, image_shape, target_accuracy: float | None,
                 target_compute: float | None) -> dict[str, Any]:
    """Pick the threshold on `loader` (the validation split), set it on the model, say what was chosen."""
    logits, targets = all_exit_logits(model, loader, device)
    chosen = calibrate(sweep(logits, targets, exit_costs(model, image_shape)), target_accuracy, target_compute)
    model.threshold = check_threshold(chosen.threshold)
    met = reached(chosen, target_accuracy, target_compute)
    if not met:  # the nearest threshold, and what would meet the target
        from torchcls.console import console

        target, fix = (f"accuracy {target_accuracy:.4f}", "train longer, or lower --target-accuracy") \
            if target_accuracy is not None else (f"compute {target_compute:.2f} of the backbone",
                                                 "raise --target-compute")
        console.print(f"[yellow]no exit threshold reaches {target} on the validation split ({len(targets)} "
                      f"images); using the nearest: threshold {chosen.threshold:.4g}, accuracy {chosen.accuracy:.4f}, "
                      f"{chosen.relative_compute:.0%} of the backbone's compute. To reach it: {fix}[/]")
    return {"target_accuracy": target_accuracy, "target_compute": target_compute, "n": len(targets),
            "chosen": asdict(chosen), "reached": met}


def _take(loader, n: int):
    seen = 0
    for x, y in loader:
        yield x, y
        seen += len(x)
        if seen >= n:
            return


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device

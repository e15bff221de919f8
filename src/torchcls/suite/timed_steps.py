"""Timed training steps with no host synchronisation inside the timed region: how benchmarks compare
training configurations (precisions, FP8 recipes, compile) fairly on a GPU.

A step that reads a scalar back (`loss.item()`, a per-step NaN check) makes the host wait for the GPU
every step, which exposes launch overhead, and hurts most the configurations with many small kernels
(FP8's amax and cast kernels). Here the NaN/Inf check is the plan's deferred one (a fused optimizer
skips a non-finite update from a device flag; `PrecisionPlan.check` reads it once at the end), the
losses stay device tensors until the end, and one pair of CUDA events spans all timed steps. On CUDA the
timed steps run under torch's sync debug mode, which counts any synchronisation that still happens.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def fused_adamw(model: nn.Module, lr: float = 1e-4) -> torch.optim.Optimizer:
    """The optimizer of every arm: fused AdamW, which can skip an update from a device flag (the deferred
    NaN/Inf check needs that)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_train_steps(model: nn.Module, plan, optimizer: torch.optim.Optimizer,
                      batches: Sequence[tuple[torch.Tensor, torch.Tensor]], warmup: int, steps: int) -> dict[str, Any]:
    """Run 1 + `warmup` untimed steps (the first compiles), then `steps` timed ones, through `plan` (a
    PrecisionPlan: autocast, backward, the deferred check, FP8's post-step hook). Returns step time,
    images/s, the first step's seconds, every step's loss and, on CUDA, the host synchronisations seen."""
    device = batches[0][0].device
    deferred = plan.defer_checks(optimizer)
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with plan.autocast():
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        plan.backward_step(loss, optimizer, model, 1.0, i + 1)
        losses.append(loss.detach())

    t = time.perf_counter()
    step(0)
    _sync(device)
    first_s = time.perf_counter() - t
    for i in range(1, 1 + warmup):
        step(i)
    _sync(device)
    elapsed_ms, syncs = _timed(device, lambda: [step(i) for i in range(1 + warmup, 1 + warmup + steps)])
    plan.check()  # the deferred NaN/Inf record: one read, after the timed steps
    ms = elapsed_ms / steps
    return {"step_ms": round(ms, 3), "images_per_s": round(len(batches[0][0]) / ms * 1e3, 1),
            "first_step_s": round(first_s, 1), "timed_steps": steps, "deferred_nonfinite_check": deferred,
            "host_syncs_in_timed_steps": syncs, "losses": [round(v, 5) for v in torch.stack(losses).float().tolist()],
            "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda"
            else None}


def _timed(device: torch.device, run) -> tuple[float, int | None]:
    """Milliseconds of run() from one CUDA event pair (wall time on a CPU), and on CUDA the synchronisations
    torch's sync debug mode reported while it ran."""
    if device.type != "cuda":
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) * 1e3, None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            start.record()
            run()
            end.record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    syncs = sum("synchroniz" in str(w.message).lower() for w in seen)
    return start.elapsed_time(end), syncs

"""Per-rank memory: parameter, gradient and optimizer-state bytes held by this rank, its peak
memory (CUDA allocator peak/reserved on GPU, peak RSS of the process on CPU), next to the
analytic expectation: FSDP2 shards every DTensor over the world (full size / world size),
DDP keeps a full replica on every rank.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.run_files import write_text_atomic
from torchcls.training.distributed import Session


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    params = [p for p in model.parameters()]
    return {"param_bytes": params, "grad_bytes": [p.grad for p in params if p.grad is not None],
            "optimizer_bytes": [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]}


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _expected_bytes(t: torch.Tensor, world: int) -> float:
    """Full size / world for a sharded (DTensor) tensor; full size for a replicated one."""
    from torch.distributed.tensor import DTensor

    full = t.numel() * t.element_size()  # a DTensor's numel is its global size
    return full / world if isinstance(t, DTensor) else full


def _vm_hwm_bytes() -> int | None:
    """Linux: the process's peak RSS since start or since the last reset_peak_memory()."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


def reset_peak_memory() -> None:
    """Measure peaks from here on: the CUDA allocator's, and on Linux the peak RSS (writing 5 to
    /proc/self/clear_refs resets VmHWM), so that e.g. building the full model before sharding it
    does not count as a training step's memory."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory() -> dict[str, int]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hwm = _vm_hwm_bytes()
    out = {"peak_rss_bytes": hwm if hwm is not None else rss if sys.platform == "darwin" else rss * 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["cuda_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def measure(model: nn.Module, optimizer: torch.optim.Optimizer, session: Session) -> dict[str, Any]:
    groups = _tensors(model, optimizer)
    full = {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in groups.items()}
    local = {k: sum(_local_bytes(t) for t in ts) for k, ts in groups.items()}
    expected = {k: sum(_expected_bytes(t, session.world) for t in ts) for k, ts in groups.items()}
    return {"rank": session.rank, **local, "total_bytes": sum(local.values()),
            "expected_total_bytes": sum(expected.values()), "expected": expected, "full": full,
            **peak_memory()}


def record_memory(run_path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  session: Session) -> dict[str, Any] | None:
    """All ranks measure; rank 0 writes memory.json with one entry per rank."""
    ranks = session.gather_objects(measure(model, optimizer, session))
    if not session.is_main:
        return None
    full = ranks[0]["full"]
    report = {"parallel": session.parallel, "world_size": session.world,
              "full_bytes": full, "full_total_bytes": sum(full.values()),
              "expected_per_rank_total_bytes": ranks[0]["expected_total_bytes"],
              "ranks": [{k: v for k, v in r.items() if k != "full"} for r in ranks]}
    write_text_atomic(run_path / "memory.json", json.dumps(report, indent=2))
    return report

"""The CUDA caching allocator, read during training: allocated vs reserved, fragmentation, retries, OOMs.

Fragmentation here is `inactive_split_bytes / reserved_bytes`: memory the allocator holds
in blocks that were split and are now partly free, which it cannot hand out for a larger
request. When it is high, or the allocator had to free its cache and retry (`num_alloc_retries`),
`expandable_segments` (one growing segment per stream instead of fixed-size ones) usually helps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchcls.run_files import replace_file

FRAGMENTATION_ADVICE_PCT = 20.0  # above this, the cache wastes enough to matter for the batch size that fits
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def sample(stats: dict[str, Any], step: int) -> dict[str, int]:
    """The few numbers per step that the report plots (from torch.cuda.memory_stats())."""
    return {"step": step, "allocated": stats.get("allocated_bytes.all.current", 0),
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "inactive_split": stats.get("inactive_split_bytes.all.current", 0)}


def summarize(stats: dict[str, Any], samples: list[dict[str, int]]) -> dict[str, Any]:
    """Peaks, fragmentation % and advice from the final memory_stats() and the per-step samples."""
    reserved_peak = stats.get("reserved_bytes.all.peak", 0)
    frag = [100.0 * s["inactive_split"] / s["reserved"] for s in samples if s["reserved"]]
    summary = {
        "allocated_peak_bytes": stats.get("allocated_bytes.all.peak", 0),
        "reserved_peak_bytes": reserved_peak,
        "inactive_split_peak_bytes": stats.get("inactive_split_bytes.all.peak", 0),
        "fragmentation_pct_max": max(frag, default=0.0),
        "fragmentation_pct_last": frag[-1] if frag else 0.0,
        "reserved_unused_pct_at_peak": 100.0 * (1 - stats.get("allocated_bytes.all.peak", 0) / reserved_peak)
        if reserved_peak else 0.0,
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
        "num_device_alloc": stats.get("num_device_alloc", 0),
        "num_device_free": stats.get("num_device_free", 0),
    }
    summary["advice"] = advice(summary, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    return summary


def advice(s: dict[str, Any], alloc_conf: str) -> list[str]:
    tips = []
    expandable_on = "expandable_segments:true" in alloc_conf.replace(" ", "").lower()
    if (s["fragmentation_pct_max"] > FRAGMENTATION_ADVICE_PCT or s["num_alloc_retries"]) and not expandable_on:
        tips.append(f"fragmentation up to {s['fragmentation_pct_max']:.0f}% and {s['num_alloc_retries']} alloc "
                    f"retries: set {EXPANDABLE} to let segments grow instead of splitting fixed blocks")
    if s["num_alloc_retries"]:
        tips.append("alloc retries mean cudaMalloc failed and the cache was flushed (slow steps): the run is "
                    "at the memory limit; lower the batch size or use activation checkpointing")
    if s["num_ooms"]:
        tips.append(f"{s['num_ooms']} out-of-memory error(s): lower the batch size, use bf16, or shard with FSDP2")
    if s["num_device_free"] > 10 and s["num_device_free"] > s["num_device_alloc"] // 4:
        tips.append("the allocator often returns memory to the driver (torch.cuda.empty_cache or retries): avoid "
                    "empty_cache in the loop")
    return tips


def start_history(max_entries: int = 100_000) -> None:
    """Record alloc/free stacks for a snapshot (CUDA only; raises without a driver, so callers guard)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_snapshot(path: Path) -> Path:
    """Write the snapshot that https://pytorch.org/memory_viz opens (drag the .pickle onto the page)."""
    import torch

    replace_file(path, torch.cuda.memory._dump_snapshot)  # a run dir's file: the name replaced, never written through
    torch.cuda.memory._record_memory_history(enabled=None)
    return path

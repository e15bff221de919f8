"""`MemoryRecorder`: a training callback that writes allocator.json (and a snapshot) into the run dir."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from torchcls.console import console
from torchcls.memory import allocator, cpu_profile
from torchcls.run_files import write_text_atomic

CUDA_NOTE = ("allocator stats (allocated/reserved, fragmentation, alloc retries, OOMs) and memory snapshots need "
             "a CUDA device; on CPU this report uses the profiler's memory events and the process RSS instead")


class MemoryRecorder:
    """Call once per optimizer step; `finish()` writes allocator.json."""

    def __init__(self, run_dir: Path, device: torch.device, snapshot: bool = False, sample_every: int = 1):
        self.run_dir, self.device, self.snapshot = Path(run_dir), device, snapshot
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.sample_every, self.samples, self.rss = sample_every, [], []
        self.profiler: cpu_profile.StepProfiler | None = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            if snapshot:
                allocator.start_history()
        else:
            self.profiler = cpu_profile.StepProfiler(self.run_dir)

    def __call__(self, step: int) -> None:
        if self.cuda:
            if step % self.sample_every == 0:
                self.samples.append(allocator.sample(torch.cuda.memory_stats(self.device), step))
        else:
            self.profiler.step()
            import psutil

            self.rss.append({"step": step, "rss": psutil.Process(os.getpid()).memory_info().rss})

    def finish(self) -> dict[str, Any]:
        report: dict[str, Any] = {"device": str(self.device), "cuda": self.cuda}
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            report |= {"allocator": {"available": True} | allocator.summarize(stats, self.samples),
                       "samples": self.samples}
            if self.snapshot:
                path = allocator.dump_snapshot(self.run_dir / "memory_snapshot.pickle")
                report["snapshot"] = {"file": path.name, "open_with": "https://pytorch.org/memory_viz"}
        else:
            self.profiler.stop()
            report |= {"allocator": {"available": False, "reason": CUDA_NOTE},
                       "profiler": self.profiler.result or {"profiled_steps": 0,
                                                            "note": "the run had too few steps to profile (needs 5)"},
                       "peak_rss_bytes": cpu_profile.peak_rss_bytes(), "samples": self.rss}
            if self.snapshot:
                report["snapshot"] = {"file": None, "reason": "--memory-snapshot needs CUDA (memory history is "
                                      "recorded by the CUDA caching allocator); see memory_timeline.json instead"}
        write_text_atomic(self.run_dir / "allocator.json", json.dumps(report, indent=2))
        _print(report)
        return report


def _print(r: dict[str, Any]) -> None:
    if r["cuda"]:
        a = r["allocator"]
        console.print(f"memory: peak allocated {a['allocated_peak_bytes'] / 2**20:.0f} MiB, reserved "
                      f"{a['reserved_peak_bytes'] / 2**20:.0f} MiB, fragmentation max {a['fragmentation_pct_max']:.1f}%,"
                      f" retries {a['num_alloc_retries']}, OOMs {a['num_ooms']}")
        for tip in a["advice"]:
            console.print(f"[yellow]memory advice: {tip}[/]")
    else:
        console.print(f"memory: peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB; {CUDA_NOTE}")


def recorder_for(train_cfg, run_dir: Path, device: torch.device) -> MemoryRecorder | None:
    """The recorder a TrainConfig asks for (--memory-report / --memory-snapshot), or None."""
    if not (train_cfg.memory_report or train_cfg.memory_snapshot):
        return None
    return MemoryRecorder(run_dir, device, snapshot=train_cfg.memory_snapshot)

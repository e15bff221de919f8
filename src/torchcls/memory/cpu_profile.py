"""CPU stand-in for the allocator report: the profiler's memory events over a few steps, and RSS.

There is no caching allocator on CPU (torch.cuda.memory_stats() is empty and memory
history needs a CUDA driver), so we profile a short window of training steps with
`profile_memory=True` and read (a) bytes allocated per op and (b) the memory timeline by
category (parameters, optimizer state, activations, gradients...) at its peak.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.io_files import SMALL_JSON_BYTES, read_bytes
from torchcls.noise import KINETO_CPU_ONLY, stderr_without
from torchcls.run_files import replace_file

# Index 1.. of each timeline row, in torch.profiler._memory_profiler._CATEGORY_TO_COLORS order.
TIMELINE_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                       "autograd_detail", "unknown")
# memory_timeline.json as torch writes it: [times, rows of (time, bytes per category)], ~16 rows a step. Every
# value takes >= 3 bytes ("0, "), so the count is what the byte bound allows; the shape bounds the nesting at 3.
TIMELINE = JsonBounds(max_bytes=SMALL_JSON_BYTES, max_values=SMALL_JSON_BYTES // 3, max_depth=3, max_str=64)


class StepProfiler:
    """Profiles steps [wait+1 .. wait+warmup+active]; `result` is set when the window closes."""

    def __init__(self, out_dir: Path, wait: int = 1, warmup: int = 1, active: int = 3):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.out_dir, self.active = out_dir, active
        self.result: dict[str, Any] | None = None
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                            with_stack=True, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                            on_trace_ready=self._ready)
        with stderr_without(KINETO_CPU_ONLY):  # kineto's GPU probe in a CUDA build on a CPU (torchcls.noise)
            self.prof.start()
        self.running = True

    def step(self) -> None:
        if self.running and self.result is None:  # after the window the profiler has nothing left to do
            with stderr_without(KINETO_CPU_ONLY):
                self.prof.step()

    def stop(self) -> None:
        if self.running:
            with stderr_without(KINETO_CPU_ONLY):
                self.prof.stop()
            self.running = False

    def _ready(self, prof) -> None:
        # Events are cleared after this callback: read everything here.
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_memory_usage, reverse=True)
        top = [{"op": e.key, "allocated_bytes": e.self_cpu_memory_usage, "calls": e.count}
               for e in ops[:10] if e.self_cpu_memory_usage > 0]
        timeline_file = self.out_dir / "memory_timeline.json"
        with warnings.catch_warnings():  # deprecated in favour of the CUDA-only snapshot: still the CPU tool
            warnings.simplefilter("ignore", FutureWarning)
            replace_file(timeline_file, lambda tmp: prof.export_memory_timeline(tmp, device="cpu"))  # (never via a link)
        self.result = {"profiled_steps": self.active, "top_ops": top,
                       "allocated_bytes_total": sum(max(0, e.self_cpu_memory_usage) for e in ops),
                       "timeline_file": timeline_file.name} | timeline_peak(timeline_file)


def read_timeline(data: bytes, where: str) -> tuple[list, list]:
    """torch's memory timeline JSON: [times, [[time, bytes per category...], ...]], parsed under TIMELINE."""
    value = load_bounded(data, TIMELINE, where)
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value)):
        raise UserError(f"{where}: not a memory timeline ([times, sizes]): refused")
    return value[0], value[1]


def timeline_peak(path: Path) -> dict[str, Any]:
    times, sizes = read_timeline(read_bytes(path, max_bytes=SMALL_JSON_BYTES, what="memory timeline"), str(path))
    if not times:
        return {"timeline_peak_bytes": 0, "timeline_at_peak": {}}
    totals = [sum(row[1:]) for row in sizes]
    i = max(range(len(totals)), key=totals.__getitem__)
    return {"timeline_peak_bytes": totals[i],
            "timeline_at_peak": dict(zip(TIMELINE_CATEGORIES, sizes[i][1:], strict=False))}


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

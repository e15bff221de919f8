"""Time and peak-RSS bounds for a block of test code: a refusal that comes after the allocation it guards
against fails the test even when it ends in the right error."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path


def status_mb(field: str) -> float:
    """A /proc/self/status figure (VmRSS, VmHWM...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


class Stopwatch:
    """Seconds since it started, as the lesser of the wall-clock time and this process's CPU time: a machine
    busy with other work stretches the first, threads multiply the second, and only work that grows with a
    hostile input (what these bounds are for) stretches both. Not for a hang, which takes no CPU."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def seconds(self) -> float:
        return min(time.perf_counter() - self.wall, time.process_time() - self.cpu)


@contextmanager
def bounded(seconds: float = 1.0, rss_mb: float = 100):
    """Fails if the block takes longer than `seconds` (a Stopwatch's) or its peak RSS rises `rss_mb` above the
    RSS at its start (the peak is reset first through /proc/self/clear_refs, so earlier tests' peaks do not
    hide anything)."""
    Path("/proc/self/clear_refs").write_text("5")
    start_rss, watch = status_mb("VmRSS"), Stopwatch()
    yield
    took, grew = watch.seconds(), status_mb("VmHWM") - start_rss
    assert took < seconds, f"took {took:.2f} s"
    assert grew < rss_mb, f"peak RSS grew {grew:.0f} MB"

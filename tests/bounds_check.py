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


@contextmanager
def bounded(seconds: float = 1.0, rss_mb: float = 100):
    """Fails if the block takes longer than `seconds` or its peak RSS rises `rss_mb` above the RSS at its start
    (the peak is reset first through /proc/self/clear_refs, so earlier tests' peaks do not hide anything)."""
    Path("/proc/self/clear_refs").write_text("5")
    start_rss, start = status_mb("VmRSS"), time.perf_counter()
    yield
    took, grew = time.perf_counter() - start, status_mb("VmHWM") - start_rss
    assert took < seconds, f"took {took:.2f} s"
    assert grew < rss_mb, f"peak RSS grew {grew:.0f} MB"

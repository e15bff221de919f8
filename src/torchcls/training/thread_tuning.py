"""The intra-op thread count re-chosen from the DataLoader workers' measured load, once, early in the run.

At the start, `machine.choose_threads` reserves one CPU per worker process (at most half of the CPUs), because
an OpenMP thread whose core a decoding worker takes stalls every barrier. Workers that have little to do (their
prefetch ahead of the step, cheap decodes) leave that reservation idle. So over a window of optimizer steps
early in the first epoch, the workers' CPU time (the children of this process, through psutil) over the wall
time says how many CPUs they keep busy; the threads keep ceil(that) of the reservation and take back the rest
(`torch.set_num_threads` between two steps: it applies from the next op on). It never reserves more than at the
start, so the count only grows. One process on the CPU only, and only where the rule chose the count (no
--threads, no OMP_NUM_THREADS: their reservation is 0).

The window is counted in steps, not seconds, so an uninterrupted run and a resumed one change the count at the
same step: machine.json records the step and the count, a resume past it applies the count before its first
step, and a resume before it measures again at that step. With --compile, Inductor's C++ kernels keep the
count they were generated with; the ATen ops between them (convolutions, matrix multiplies) follow the new one.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import psutil
from pydantic import Field
from typing_extensions import TypedDict

from torchcls import run_files
from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.config import INT_RANGES
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.io_files import SMALL_JSON_BYTES
from torchcls.machine import ThreadChoice, apply_threads, cpu_budget
from torchcls.run_files import write_text_atomic
from torchcls.typed_json import check

WARMUP_STEPS = 5  # the first steps compile (--compile), fill the workers' prefetch queue and warm the allocator
WINDOW_STEPS = 50  # enough wall time for the kernel's 10 ms CPU-time ticks to say little of one step
# A worker using a tenth of a CPU or less (its share of a short window is within the tick resolution) takes no core
# machine.json: the CPU, cores, quota and thread choices of a run (a few hundred bytes), read back on --resume.
MACHINE_RECORD = JsonBounds(max_bytes=SMALL_JSON_BYTES, max_values=10_000, max_depth=8, max_str=4096,
                            allow_nonfinite=True)
IDLE_CPUS = 0.1
# A recorded count is applied with torch.set_num_threads (OpenMP starts that many threads): at most what --threads
# may ask for, so a received machine.json cannot ask for a million threads (or overflow the call, past 2^63).
MAX_THREADS = INT_RANGES[("train", "threads")].hi


class MachineRecord(TypedDict, total=False):
    """The fields of machine.json a resume acts on; the rest (CPU model, cores, precision) is only read by people."""
    torch_threads: Annotated[int, Field(ge=1, le=MAX_THREADS)]
    threads_reserved_for_workers: Annotated[int, Field(ge=0, le=MAX_THREADS)]
    threads_after_measurement: Annotated[int, Field(ge=1, le=MAX_THREADS)]
    worker_load_cpus: float
    measured_over_steps: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)]

Reading = Mapping[tuple[int, float], float]  # (pid, create time) -> CPU seconds (user + system)


def window(steps_per_epoch: int) -> tuple[int, int] | None:
    """(first, last) optimizer step of the measurement, within the first epoch (so --epochs, which a resume may
    raise, does not move it); None where the epoch is too short to measure and still use the result."""
    first = min(WARMUP_STEPS, steps_per_epoch // 4)
    last = first + min(WINDOW_STEPS, (steps_per_epoch - first) // 2)
    return (first, last) if last > first else None


def worker_load(before: Reading, after: Reading, wall_s: float) -> float:
    """CPUs' worth of work the child processes did between two readings: a child that started in the window
    counts all its time, one that ended in it is left out (its last seconds are not readable)."""
    if wall_s <= 0:
        return 0.0
    return sum(max(0.0, cpu - before.get(child, 0.0)) for child, cpu in after.items()) / wall_s


def reservation(load: float, reserved: int) -> int:
    """CPUs the workers keep: the whole CPUs their load needs, never more than reserved at the start."""
    return min(reserved, max(0, math.ceil(load - IDLE_CPUS)))


def retuned(choice: ThreadChoice, load: float) -> int:
    """The thread count once the workers' `load` is known: the start's count plus what they leave idle."""
    return max(1, choice.threads + choice.reserved - reservation(load, choice.reserved))


def children_cpu_seconds(process: psutil.Process | None = None) -> dict[tuple[int, float], float]:
    """Each child process's CPU seconds: the DataLoader's workers (and any other child: idle ones, such as
    Inductor's compile workers after warm-up, add nothing; a busy one takes a core just as a worker does)."""
    found = {}
    for child in (process or psutil.Process()).children(recursive=True):
        try:
            with child.oneshot():
                t = child.cpu_times()
                found[(child.pid, child.create_time())] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # ended, or not ours to read: no load to count
            continue
    return found


def read_record(path: Path) -> dict[str, Any]:
    """machine.json of the run being resumed ({} where there is none); a UserError naming the field where one a
    resume acts on (`MachineRecord`) is of another type or past its range."""
    if not path.is_file() and not path.is_symlink():
        return {}
    # (not rundir.read_checked: JSON it cannot parse, within bounds or not, is named as no machine record)
    data = run_files.read_bytes(path, max_bytes=SMALL_JSON_BYTES, what="machine.json")
    try:
        record = load_bounded(data, MACHINE_RECORD, str(path))
    except UserError as e:
        raise UserError(f"{path}: not a JSON machine record ({e}); remove it to resume with a new thread "
                        "count") from None
    return check(record, MachineRecord, str(path), hint="remove it to resume with a new thread count")


class WorkerLoadTuner:
    """A step callback (after each optimizer step) and an epoch-start hook (`begin`, given the global step)."""

    def __init__(self, choice: ThreadChoice, machine_json: Path, steps: tuple[int, int],
                 recorded: Mapping[str, Any]):
        self.choice, self.path, (self.first, self.last) = choice, machine_json, steps
        self.before: tuple[Reading, float] | None = None
        self.done = False
        span, final = recorded.get("measured_over_steps"), recorded.get("threads_after_measurement")
        self.recorded = None
        if _is_steps(span) and isinstance(final, int) and final > 0:  # a resumed run measured before
            self.first, self.last = span
            self.recorded = recorded

    def begin(self, step: int) -> None:
        """Before the run's (or the resumed run's) first step: past the window, apply its recorded outcome."""
        if self.done or self.before is not None:
            return
        if step >= self.last:
            self.done = True
            if self.recorded is not None:
                load = self.recorded.get("worker_load_cpus")
                most = self.choice.threads + self.choice.reserved  # the reservation all given back, no more
                self._apply(min(self.recorded["threads_after_measurement"], most),
                            load if isinstance(load, float) else 0.0, "(resume: the count this run measured)")
        elif step >= self.first:  # resumed inside the window: measure what is left of it
            self.before = (children_cpu_seconds(), time.monotonic())

    def __call__(self, step: int) -> None:
        if self.done:
            return
        if step == self.first and self.before is None:
            self.before = (children_cpu_seconds(), time.monotonic())
        elif step == self.last and self.before is not None:
            (before, t0), self.done = self.before, True
            load = worker_load(before, children_cpu_seconds(), time.monotonic() - t0)
            self._apply(retuned(self.choice, load), load)

    def _apply(self, threads: int, load: float, note: str = "") -> None:
        apply_threads(ThreadChoice(threads, "", 0))
        console.print(f"threads {self.choice.threads} -> {threads} after step {self.last}: loader workers kept "
                      f"{load:.2f} CPU(s) busy over steps {self.first}-{self.last}, {self.choice.reserved} "
                      f"reserved at the start{' ' + note if note else ''}", highlight=False)
        record = read_record(self.path) | {"threads_after_measurement": threads, "worker_load_cpus": round(load, 3),
                                           "measured_over_steps": [self.first, self.last]}
        write_text_atomic(self.path, json.dumps(record, indent=2))


def _is_steps(span: Any) -> bool:
    return (isinstance(span, list) and len(span) == 2 and all(isinstance(s, int) and s >= 0 for s in span)
            and span[0] < span[1])


def recorded_reservation(recorded: Mapping[str, Any]) -> int:
    """The CPUs a resumed run reserved for workers at its start, bounded by the rule's maximum (half the usable
    CPUs): a count in the file never raises the threads past what the rule could have chosen."""
    reserved = recorded.get("threads_reserved_for_workers")
    return min(reserved, cpu_budget().usable // 2) if isinstance(reserved, int) and reserved > 0 else 0


def tuner_for(choice: ThreadChoice, machine_json: Path, steps_per_epoch: int, recorded: Mapping[str, Any],
              *, single_cpu_process: bool) -> WorkerLoadTuner | None:
    """The tuner where it applies: one process on the CPU, the count chosen by the rule with CPUs reserved for
    workers, and an epoch long enough to measure."""
    steps = window(steps_per_epoch)
    if not single_cpu_process or choice.reserved <= 0 or steps is None:
        return None
    return WorkerLoadTuner(choice, machine_json, steps, recorded)

"""What this machine is, for choosing defaults and for recording them: the CPU's model and SIMD level,
the CPUs this process may use (affinity and cgroup quota), and the intra-op thread count that follows.
torch reads the CPU (torch.cpu.get_capabilities, torch.backends.cpu), psutil the counts, the affinity
mask and the CPU times; only the cgroup quota, which neither reads, is read here from its files.

The readers take their inputs as parameters (the flags, the cgroup folder, the affinity set, the
environment), so tests feed them a fake machine; the defaults read this one.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")

# Highest first: the first level whose flags the CPU has names it (torch spells avx512_f, /proc/cpuinfo avx512f).
SIMD_LEVELS = (("AMX", ("amx_bf16", "amx_tile")), ("AVX-512-bf16", ("avx512_bf16",)),
               ("AVX-512", ("avx512f", "avx512_f")), ("AVX2", ("avx2",)), ("AVX", ("avx",)),
               ("SVE", ("sve",)), ("NEON", ("asimd", "neon")))


def _torch_cpu() -> dict[str, Any]:
    """torch's own reading of the CPU (its cpuinfo library, on x86 and Arm alike): feature flags as
    {name: True/False}, and `cpu_name`."""
    import torch

    caps = getattr(torch.cpu, "get_capabilities", None)  # (older torch lacks it: no flags, so auto stays fp32)
    return dict(caps()) if caps is not None else {}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags in torch's spelling (avx512_f, avx512_bf16, amx_bf16, ...)."""
    return frozenset(k for k, v in _torch_cpu().items() if v is True)


def cpu_model() -> str:
    name = _torch_cpu().get("cpu_name")
    return name if isinstance(name, str) and name.strip() else platform.processor() or platform.machine() or "unknown CPU"


def simd_level(flags: Iterable[str]) -> str:
    """AMX, AVX-512-bf16, AVX-512, AVX2, ... : the widest vector instructions the CPU has."""
    have = set(flags)
    return next((level for level, names in SIMD_LEVELS if have & set(names)), "scalar/SSE")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use: psutil.cpu_count() is the machine's, not the process's."""

    logical: int  # psutil.cpu_count()
    affinity: int  # CPUs in the affinity mask (taskset, cpuset, Kubernetes static CPU manager)
    quota: float | None  # CPUs' worth of time the cgroup quota allows per period; None = no quota

    @property
    def usable(self) -> int:
        # Floor, not ceil: a quota of 1.5 CPUs throttles the second thread half of every period, and an
        # OpenMP barrier then waits for it (the same stall as a busy core).
        limit = self.affinity if self.quota is None else min(self.affinity, max(1, math.floor(self.quota)))
        return max(1, limit)

    def describe(self) -> str:
        quota = "no cgroup quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        return f"{self.usable} usable CPU(s): {self.logical} logical, {self.affinity} in the affinity mask, {quota}"


# The cgroup CPU quota is read here because neither psutil nor torch reads it: psutil.cpu_count() and
# cpu_affinity() see the affinity mask only, and a container limited by `docker --cpus 2` or a Kubernetes
# CPU limit (cpu.max / cpu.cfs_quota_us) on a 64-core node would otherwise start 64 threads.
def _cgroup_paths(self_cgroup: str) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 `cpu` controller path, from /proc/self/cgroup's text."""
    v2 = v1 = None
    for line in self_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _ancestors(root: Path, rel: str | None) -> list[Path]:
    """`root/rel` and each parent up to `root`: a limit set on any of them applies. In a container without
    its own cgroup namespace, rel is the host's path and missing here: then the root alone is read."""
    parts = [p for p in (rel or "").split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_quota(quota: str, period: str) -> float | None:
    if quota.strip() in ("max", "-1", ""):
        return None
    q, p = int(quota), int(period)
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """CPUs' worth of time the cgroup quota allows (quota / period), the tightest over this process's cgroup
    and its ancestors; None = no quota. cgroup v2: `cpu.max` ("max 100000" or "200000 100000"); v1:
    `cpu/cpu.cfs_quota_us` (-1 = none) over `cpu.cfs_period_us` (also under `cpu,cpuacct/`)."""
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    v2, v1 = _cgroup_paths(self_cgroup)
    found: list[float] = []
    for d in _ancestors(root, v2):
        f = d / "cpu.max"
        if f.is_file():
            fields = f.read_text().split() + ["100000"]
            found += [q for q in [_read_quota(fields[0], fields[1])] if q is not None]
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _ancestors(root / controller, v1):
            q, p = d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"
            if q.is_file() and p.is_file():
                found += [v for v in [_read_quota(q.read_text(), p.read_text())] if v is not None]
    return min(found) if found else None


def cpu_budget(root: Path = CGROUP_ROOT, self_cgroup: str | None = None,
               affinity: set[int] | None = None) -> CpuBudget:
    logical = psutil.cpu_count() or 1
    if affinity is None:
        affinity = usable_cpus()
    return CpuBudget(logical, len(affinity) or logical, cgroup_cpu_limit(root, self_cgroup))


def usable_cpus() -> set[int]:
    """The CPUs in this process's affinity mask (every CPU where the platform has no mask: macOS)."""
    try:
        return set(psutil.Process().cpu_affinity())
    except AttributeError:  # psutil offers cpu_affinity only where the OS has one
        return set(range(psutil.cpu_count() or 1))


MIN_WINDOW_S = 0.1  # the kernel counts CPU time in 10 ms ticks: a shorter window says little


def _idle_and_total(t: Any) -> tuple[float, float]:
    """(idle + iowait seconds, all seconds) of one CPU's psutil.cpu_times(). Guest time is already counted
    in user/nice time on Linux (psutil.cpu_percent leaves it out for the same reason)."""
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return t.idle + getattr(t, "iowait", 0.0), total


def other_work(cpus: set[int], before: Sequence[Any], after: Sequence[Any], own_cpu_s: float) -> tuple[int, str]:
    """How many of `cpus` other processes kept busy between two psutil.cpu_times(percpu=True) readings
    (this process's own CPU time `own_cpu_s` over the window taken out), rounded to whole CPUs, and a
    line saying so. psutil lists the online CPUs in order: with every CPU online, index = CPU number."""
    other, seen = other_cpus(cpus, before, after, own_cpu_s)
    n = min(seen - 1, int(other + 0.5)) if seen else 0
    return (n, f"other work kept {other:.1f} of {seen} CPU(s) busy as the run started") if n else (0, "")


def other_cpus(cpus: set[int], before: Sequence[Any], after: Sequence[Any], own_cpu_s: float) -> tuple[float, int]:
    """The CPUs' worth of time other processes spent on `cpus` between the two readings, and how many of `cpus`
    were read."""
    seen = [c for c in cpus if c < min(len(before), len(after))]
    if not seen:
        return 0.0, 0
    t0 = {c: _idle_and_total(before[c]) for c in seen}
    t1 = {c: _idle_and_total(after[c]) for c in seen}
    window = max(t1[c][1] - t0[c][1] for c in seen)  # seconds of one CPU's time that passed
    if window <= 0:
        return 0.0, len(seen)
    busy = sum((t1[c][1] - t0[c][1]) - (t1[c][0] - t0[c][0]) for c in seen)
    return max(0.0, (busy - own_cpu_s) / window), len(seen)


class CpuActivity:
    """Other processes' CPU use from its creation (the run's start) to `busy()` (when its threads are chosen): the
    window covers the run's own data loading, whose CPU time is taken out, so measuring costs no extra time.
    `other()` gives the same as a fraction of CPUs, for a window that some timing must have to itself."""

    def __init__(self):
        self.before = psutil.cpu_times(percpu=True)
        self.own, self.t0 = time.process_time(), time.monotonic()

    def busy(self) -> tuple[int, str]:
        return other_work(*self._window()) if self.before else (0, "")

    def other(self) -> float:
        return other_cpus(*self._window())[0] if self.before else 0.0

    def _window(self) -> tuple[set[int], Sequence[Any], Sequence[Any], float]:
        time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - self.t0)))
        return usable_cpus(), self.before, psutil.cpu_times(percpu=True), time.process_time() - self.own


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    # CPUs the DataLoader workers' reservation took from the threads; training/thread_tuning.py gives back those
    # the workers leave idle
    reserved: int = 0


def choose_threads(requested: int = 0, loader_workers: int = 0, budget: CpuBudget | None = None,
                   env: Mapping[str, str] | None = None, busy: tuple[int, str] | None = None) -> ThreadChoice:
    """The intra-op thread count: `requested` (--threads) when given, else OMP_NUM_THREADS when set (by you,
    or by torchrun for several processes per node), else the rule below on the CPUs this process may use.

    The rule: the usable CPUs (affinity, cgroup quota), shared among torchrun's processes on this node,
    less one CPU per DataLoader worker process but never more than half of them. Why: OpenMP's threads meet
    at a barrier after every op, so one thread whose core is taken (by a decoding worker, or by a quota that
    has run out) stalls all the others; on a shared 2-core machine 2 threads trained at 94 images/s against
    509 with 1. Workers are not busy all the time (they prefetch ahead), so they get at most half. For the
    same reason, CPUs that other processes keep busy when the run starts are left out (`busy`: (count, line),
    from a CpuActivity started with the run; measured here only for this machine's own budget): SmallNet
    trained at 179 images/s with 2 threads beside a busy core, ~1,000 with 1. Training records the choice
    (machine.json) and a resume keeps it; once the workers' load is measured, training gives back the reserved
    CPUs they leave idle (training/thread_tuning.py)."""
    env = os.environ if env is None else env
    if requested > 0:
        return ThreadChoice(requested, f"--threads {requested}")
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return ThreadChoice(int(env["OMP_NUM_THREADS"]), f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    own, budget = budget is None, budget or cpu_budget()  # busy CPUs are sampled on this machine's budget only
    local = max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    per_process = max(1, budget.usable // local)
    reserved = min(max(0, loader_workers), per_process // 2)
    if busy is None:
        busy = CpuActivity().busy() if own and local == 1 and per_process - reserved > 1 else (0, "")
    elif local > 1:  # several processes on this node: each would count the others' data loading as other work
        busy = (0, "")
    threads = max(1, per_process - reserved - busy[0])
    # What the reservation took from the threads: less than reserved where the floor of 1 thread cut it short
    taken = max(1, per_process - busy[0]) - threads
    why = budget.describe()
    if local > 1:
        why += f", shared by {local} processes on this node"
    if reserved:
        why += f", {reserved} left to {loader_workers} loader worker(s)"
    if busy[0]:
        why += f", {busy[1]}"
    return ThreadChoice(threads, why, taken)


def apply_threads(choice: ThreadChoice) -> ThreadChoice:
    import torch

    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    return choice


def describe_machine(precision: str | None = None, threads: ThreadChoice | None = None,
                     budget: CpuBudget | None = None) -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, SIMD level, torch's CPU capability (lower when
    ATEN_CPU_CAPABILITY forces it down), cores and quota, torch threads, GPU, and the precision chosen."""
    import torch

    flags = cpu_flags()
    budget = budget or cpu_budget()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "simd": simd_level(flags), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": asdict(budget) | {"usable": budget.usable}, "torch_threads": torch.get_num_threads(),
            "threads_reason": threads.reason if threads else None,
            "threads_reserved_for_workers": threads.reserved if threads else 0, "gpu": gpu, "precision": precision,
            "torch": torch.__version__, "platform": platform.platform()}


def machine_line(m: dict[str, Any]) -> str:
    """One line for a Markdown table header or a log: 'Intel Xeon (AMX), 2 usable of 2 CPUs (no quota), ...'."""
    cores = m["cores"]
    quota = "no quota" if cores["quota"] is None else f"quota {cores['quota']:g}"
    parts = [f"{m['cpu']} ({m['simd']}; torch {m['torch_cpu_capability']})",
             f"{cores['usable']} usable of {cores['logical']} CPUs ({quota})", f"torch threads {m['torch_threads']}"]
    if m.get("gpu"):
        parts.append(f"GPU {m['gpu']}")
    if m.get("precision"):
        parts.append(f"precision {m['precision']}")
    return ", ".join(parts)

"""--precision auto and --channels-last left unset, on a CPU: the training step is timed, not guessed.

Which memory layout and precision train fastest depends on the model, its input size and the CPU.
Training steps measured on this project's machines: ResNet-18 at 32 px is 29% faster channels-last on
an AVX2 CPU but not on AVX-512; MobileNetV3 is 48% faster channels-last in fp32 on AVX-512; with
native bf16 (AMX) FastNet's step takes half the time of fp32, MobileNetV3's and ResNet-18-at-32-px's
longer. No rule of thumb holds across them, so on a CPU the candidates (bf16 only where the CPU has it
natively: precision.hardware) are timed on a copy of the run's own model at its batch shape, interleaved,
a few forward + backward + optimizer steps each, and the fastest wins (by a margin over the rule's
choice: bf16 where native, contiguous NCHW).

A choice is cached per machine, model, shape and candidates (TORCHCLS_CACHE_DIR, default
$XDG_CACHE_HOME/torchcls/step-choices.json): a second run on the same machine makes the same choice,
as reproducibility needs; a resumed run keeps its own (step_choice.json in the run dir). Since a cached
choice governs every later run, only a trial that had the machine to itself is used and cached: where other
processes took more than QUIET_OTHER_CPUS during it, the rule decides that run and the next one times again.
Not measured (the rule decides): on a GPU (bf16 where supported, channels-last for convolution nets), under
torchrun (ranks must agree; FSDP2 refuses channels-last), for early-exit models (their time depends on
the data), and when one step of the first candidate takes longer than TRIAL_STEP_LIMIT_S.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import NotRequired, TypedDict

from torchcls.bounded_json import JsonBounds
from torchcls.errors import UserError
from torchcls.io_files import SMALL_JSON_BYTES
from torchcls.machine import CpuActivity
from torchcls.models.parts import is_convnet
from torchcls.precision.hardware import PrecisionChoice
from torchcls.precision.training import PRECISIONS
from torchcls.training.rundir import read_checked
from torchcls.typed_json import check

TRIAL_ROUNDS = (3, 9)  # timed steps per candidate (fewest, most), interleaved (A B A B ...), after one warm-up
TRIAL_BUDGET_S = 4.0  # the timed rounds of all candidates together, when the steps are fast enough to allow more
MARGIN = 1.05  # another candidate replaces the rule's only when it is this much faster: noise must not flip it
TRIAL_STEP_LIMIT_S = 1.5  # a slower step makes the trial cost more than it can save on a short run
# Other processes' CPU use during the trial, in CPUs, above which its times are not trusted: OpenMP's threads
# wait for the slowest at every op, so a neighbour on one core scrambles them (FastNet on 2 cores beside one
# busy loop: bf16 channels-last timed at 1.1-2.0x NCHW's time, run to run; 0.87x alone, every run).
QUIET_OTHER_CPUS = 0.25
# Part of the cache key: entries timed before the trial checked that it had the machine to itself are timed again.
TRIAL_VERSION = 2
CACHE_ENV = "TORCHCLS_CACHE_DIR"
STATE_FILE = "step_choice.json"
# step_choice.json (a run dir's: the precision, layout and a few step times) and the user's cache of them, one
# entry per machine and run shape (~1 KB each), parsed under these bounds: a received run dir's record is a
# few hundred bytes.
RECORD = JsonBounds(max_bytes=1 << 20, max_values=10_000, max_depth=8, max_str=4096, allow_nonfinite=True)
CACHE = JsonBounds(max_bytes=SMALL_JSON_BYTES, max_values=1_000_000, max_depth=8, max_str=1 << 16,
                   allow_nonfinite=True)


class _Precision(TypedDict):
    requested: Literal[(*PRECISIONS, "auto")]  # --precision
    precision: Literal[PRECISIONS]  # what runs: a resumed run trains in it
    reason: str
    warning: NotRequired[str]


class StepRecord(TypedDict):
    """step_choice.json, and each entry of the cache: what `from_record` makes a StepChoice of."""
    precision: _Precision
    channels_last: bool
    how: NotRequired[str]
    times_ms: NotRequired[dict[str, float]]


@dataclass(frozen=True)
class StepChoice:
    precision: PrecisionChoice
    channels_last: bool
    how: str  # measured, cached, resumed, rule, as asked
    times_ms: dict[str, float] = field(default_factory=dict)  # candidate -> median step time

    def line(self) -> str:
        layout = "channels-last" if self.channels_last else "contiguous (NCHW)"
        timed = ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(self.times_ms.items(), key=lambda kv: kv[1]))
        return f"training step: {self.precision.precision}, {layout} ({self.how}{': ' + timed if timed else ''})"

    def record(self) -> dict:
        return {"precision": self.precision.record(), "channels_last": self.channels_last, "how": self.how,
                "times_ms": self.times_ms}


def label(precision: str, channels_last: bool) -> str:
    return f"{precision}+{'cl' if channels_last else 'nchw'}"


def candidates(rule: PrecisionChoice, bf16_native: bool, channels_last: bool | None,
               model: nn.Module) -> list[tuple[str, bool]]:
    """(precision, channels_last) pairs worth timing: both precisions only when auto may pick bf16 natively,
    both layouts only when the user left --channels-last unset and the model is a convolution net."""
    precisions = ["bf16", "fp32"] if rule.requested == "auto" and bf16_native else [rule.precision]
    layouts = [True, False] if channels_last is None and is_convnet(model) else [bool(channels_last)]
    return [(p, cl) for p in precisions for cl in layouts]


def time_steps(model: nn.Module, make_optimizer: Callable, shape: tuple[int, ...], classes: int,
               options: list[tuple[str, bool]]) -> dict[str, float] | None:
    """Median ms of a training step per option, or None when one step is too slow to be worth measuring.
    Draws from the global RNG: callers fork it (choose_step does)."""
    x, y = torch.randn(shape), torch.randint(0, classes, (shape[0],))
    runs, warm = {}, {}
    for precision, cl in options:
        fmt = torch.channels_last if cl else torch.contiguous_format
        m = copy.deepcopy(model).train().to(memory_format=fmt)
        k = label(precision, cl)
        runs[k] = (m, make_optimizer(m), x.contiguous(memory_format=fmt), precision)
        warm[k] = _step(*runs[k], y)
        if warm[k] > TRIAL_STEP_LIMIT_S:  # checked at each warm-up: a slow model pays for one step, not four
            return None
    times: dict[str, list[float]] = {k: [] for k in runs}
    fewest, most = TRIAL_ROUNDS
    rounds = max(fewest, min(most, int(TRIAL_BUDGET_S / sum(warm.values()))))
    for _ in range(rounds):
        for k, run in runs.items():
            times[k].append(_step(*run, y))
    return {k: round(statistics.median(v) * 1000, 1) for k, v in times.items()}


def _step(model: nn.Module, optimizer, x: torch.Tensor, precision: str, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - t0


def cache_path() -> Path:
    base = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchcls"
    return Path(base) / "step-choices.json"


def cached(key: str) -> dict | None:
    """The cache's entry for `key`; None where there is none, or the cache (or the entry) is damaged: the step is
    then timed again, as with no cache."""
    try:  # (the cache may be reached through a link: it is the user's own, not a received run dir's)
        entry = read_checked(cache_path(), CACHE, dict, "step-choice cache", follow_symlinks=True).get(key)
        return None if entry is None else check(entry, StepRecord, f"{cache_path()}: {key}")
    except (OSError, ValueError, UserError):
        return None


def remember(key: str, entry: dict) -> None:
    """Add `entry` under `key` (a lock against parallel runs; written whole, then renamed)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                table = read_checked(path, CACHE, dict, "step-choice cache", follow_symlinks=True) \
                    if path.exists() else {}
            except (ValueError, UserError):  # a damaged cache (or no regular file) is started again
                table = {}
            table[key] = entry
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError:  # a read-only home: the choice is still made, only not remembered
        pass


def cache_key(**parts) -> str:
    return json.dumps(parts, sort_keys=True)


def read_state(state: Path) -> dict[str, Any]:
    """A resumed run's step_choice.json, or a UserError naming the field that is not what torchcls writes."""
    return read_checked(state, RECORD, StepRecord, "step choice record", hint="remove it to choose the training "
                        "step again (the run then trains in the precision and layout chosen now)")


def from_record(record: dict, how: str) -> StepChoice:
    p = record["precision"]
    return StepChoice(PrecisionChoice(p["requested"], p["precision"], p["reason"], p.get("warning", "")),
                      bool(record["channels_last"]), how, dict(record.get("times_ms", {})))


def choose_step(requested: str, channels_last: bool | None, device: torch.device, *, new_model: Callable,
                make_optimizer: Callable, shape: tuple[int, ...], classes: int, distributed: bool,
                state: Path | None, describe: dict) -> StepChoice:
    """The precision and layout a run trains in. `requested`: --precision; `channels_last`: the flag (None:
    unset); `new_model`: builds a fresh instance of the run's model; `shape`: one batch on this rank;
    `state`: the run's step_choice.json (a resumed run reads it back); `describe`: what identifies the
    machine and the run's shape in the cache (CPU, threads, torch, model name). The global RNG is left as
    it was, measured or not: the run's own model and data draw the same numbers either way."""
    with torch.random.fork_rng(devices=[]):
        return _choose(requested, channels_last, device, new_model, make_optimizer, shape, classes, distributed,
                       state, describe)


def _choose(requested: str, channels_last: bool | None, device: torch.device, new_model: Callable,
            make_optimizer: Callable, shape: tuple[int, ...], classes: int, distributed: bool, state: Path | None,
            describe: dict) -> StepChoice:
    from torchcls.models.early_exit import EarlyExitNet
    from torchcls.precision.hardware import choose_precision, cpu_bf16_here

    if state is not None and state.exists():
        record = read_state(state)
        # The run's own choice, unless this resume asks for another precision or layout: that one then applies.
        if record["precision"]["requested"] == requested and channels_last in (None, record["channels_last"]):
            return from_record(record, "resumed")
    rule = choose_precision(requested, device)
    if device.type == "cuda" or distributed or rule.precision not in ("fp32", "bf16"):
        conv = device.type == "cuda" and not distributed and is_convnet(new_model())
        return StepChoice(rule, channels_last if channels_last is not None else conv, "rule")
    model = new_model()
    options = candidates(rule, cpu_bf16_here()[0], channels_last, model)
    if len(options) == 1 or isinstance(model, EarlyExitNet):
        return StepChoice(rule, bool(channels_last), "as asked" if len(options) == 1 else "rule")
    key = cache_key(**describe, requested=requested, shape=list(shape), options=[label(*o) for o in options],
                    trial=TRIAL_VERSION)
    if (hit := cached(key)) is not None:
        return from_record(hit, "cached")
    activity = CpuActivity()
    times = time_steps(model, make_optimizer, shape, classes, options)
    if times is None:
        return StepChoice(rule, bool(channels_last), f"rule: a step takes over {TRIAL_STEP_LIMIT_S} s, not timed")
    if (other := activity.other()) > QUIET_OTHER_CPUS:  # neither used nor remembered: the next run times again
        return StepChoice(rule, bool(channels_last), f"rule: other work kept {other:.1f} CPU(s) busy while the steps "
                          "were timed, so the times were not used", times)
    default = label(rule.precision, bool(channels_last))
    best = min(times, key=times.get)
    if default in times and times[default] <= times[best] * MARGIN:
        best = default
    precision, cl = next(o for o in options if label(*o) == best)
    reason = rule.reason if precision == rule.precision else \
        f"{rule.reason}, but fp32 trains this model faster here (timed)"
    choice = StepChoice(PrecisionChoice(requested, precision, reason), cl, "measured", times)
    remember(key, choice.record())
    return choice

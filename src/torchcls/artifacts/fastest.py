"""`torchcls export --target auto` (the default): the fastest artifact that passes parity on this machine.

Which runtime is fastest depends on the model and the CPU (measured, docs/benchmarks.md: on one AVX-512-bf16
CPU AOTInductor and OpenVINO are within 10% on ResNet-18 in bf16, while ONNX Runtime runs MobileNetV3 1.8x as
fast as AOTInductor), so no fixed default can be the fast one everywhere. On the CPU, auto exports every path this
installation can build (AOTInductor; a static int8 AOTInductor package;
the ONNX model on ONNX Runtime; the same on OpenVINO), each exactly as `--target` would, with its own parity
gate and its own parity.json; then times the ones that passed on this
machine, interleaved in rounds (median), at batch 1 and at min(16, --max-batch); and returns the one with the
best geometric mean of the two speeds relative to the best of each (the timing images are random: an
early-exit model is timed on the exits they take). Its parity.json records the choice:
every candidate's figures or why it was not kept, the rounds and the thread count. The others stay on
disk, each verified, for a user who wants another trade-off. A CUDA export builds AOTInductor only (the
one path compiled for the GPU).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchcls.artifacts.artifact import load_artifact
from torchcls.artifacts.openvino_session import openvino_available
from torchcls.artifacts.targets.base import LoadedArtifact
from torchcls.console import console, phase
from torchcls.errors import UserError
from torchcls.extras import install_command

ROUNDS = 5  # interleaved timing rounds; each candidate's time is the median over them
BLOCK_S = 0.25  # one candidate at one batch size per round: half of it untimed, then the calls of the rest timed
TIMING_SEED = 3


@dataclass(frozen=True)
class Candidate:
    target: str
    runtime: str | None = None  # onnx: onnxruntime or openvino
    precision: str | None = None  # int8: a static int8 .pt2; None: the precision asked (auto: bf16 or fp32)

    @property
    def name(self) -> str:
        if self.precision:
            return f"{self.target}-{self.precision}"
        return f"{self.target}-{self.runtime}" if self.runtime == "openvino" else self.target


def candidates(device: torch.device, precision: str = "auto") -> tuple[list[Candidate], dict[str, str]]:
    """The paths auto tries on `device`, and why any other is left out (a missing extra says how to add it).
    With --precision auto a static int8 .pt2 is one of them (activations in 7 bits where the CPU's int8 kernels
    lack VNNI: quantize.int8_reduce_range): it is kept only where it agrees with eager fp32 on 99% of the
    held-out images (quantize.AOTI_INT8_MIN_AGREEMENT)."""
    if device.type != "cpu":
        return [Candidate("aoti")], {"onnx": "auto builds AOTInductor only for a GPU (name --target onnx for "
                                             "ONNX Runtime's CUDA provider)"}
    have = {m: importlib.util.find_spec(m) is not None for m in ("onnx", "onnxscript", "onnxruntime")}
    found: list[Candidate] = [Candidate("aoti")]
    left: dict[str, str] = {}
    if precision == "auto":
        if importlib.util.find_spec("torchao") is None:
            left["aoti-int8"] = f"torchao not installed: {install_command('precision')}"
        else:
            found.append(Candidate("aoti", precision="int8"))
    if all(have.values()):
        found.append(Candidate("onnx", "onnxruntime"))
    else:
        left["onnx"] = f"{', '.join(m for m, ok in have.items() if not ok)} not installed: {install_command('export')}"
    if have["onnx"] and have["onnxscript"] and openvino_available():
        found.append(Candidate("onnx", "openvino"))
    else:
        left["onnx-openvino"] = f"openvino (and onnx, onnxscript) not installed: {install_command('export')}"
    return found, left


def export_fastest(export_one: Callable[[Candidate], Any], device: torch.device, max_batch: int,
                   precision: str = "auto") -> tuple[Any, dict[str, Any]]:
    """Export every candidate with `export_one` (an ExportResult, or a UserError such as failed parity), time
    those that were written; (the fastest one's ExportResult, the choice for its parity.json)."""
    found, refused = candidates(device, precision)
    results: dict[str, Any] = {}
    for i, c in enumerate(found, 1):
        console.print(f"--target auto: exporting {c.name} ({i} of {len(found)})", highlight=False)
        try:
            results[c.name] = export_one(c)
        except UserError as e:
            refused[c.name] = str(e).splitlines()[0][:400]
            console.print(f"--target auto: {c.name} not kept: {refused[c.name]}", highlight=False)
    if not results:
        tried = {refused[c.name] for c in found}
        if len(tried) == 1:  # the same error for every target (the parity data is missing...): said once
            raise UserError(tried.pop())
        raise UserError("--target auto: no target produced an artifact that passed parity here: "
                        + "; ".join(f"{k}: {v}" for k, v in refused.items()))
    batches = sorted({1, min(16, max_batch)})
    phase(f"timing {len(results)} artifact(s) at batch {' and '.join(map(str, batches))}")
    seconds = time_artifacts({name: load_artifact(r.path) for name, r in results.items()}, batches)
    choice = choose(seconds, batches)
    for name, r in results.items():
        choice["candidates"][name] |= {"path": str(r.path), "precision": r.info.precision,
                                       "top1_agreement": r.parity["top1_agreement"]}
    choice["candidates"] |= {name: {"not_kept": why} for name, why in refused.items()}
    console.print(f"--target auto: {choice['why']}", highlight=False)
    return results[choice["chosen"]], choice


def time_artifacts(artifacts: dict[str, LoadedArtifact], batches: list[int]) -> dict[str, dict[int, float]]:
    """Median seconds per call of each artifact at each batch size, rounds interleaved (A B C, A B C ...) so
    that a change in the machine's load falls on every candidate alike."""
    first = next(iter(artifacts.values())).info.preprocess
    shape = (first.channels, first.img_size, first.img_size)
    images = torch.randn(max(batches), *shape, generator=torch.Generator().manual_seed(TIMING_SEED))
    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in artifacts}
    for _ in range(ROUNDS):
        for name, artifact in artifacts.items():
            for b in batches:
                times[name][b].append(steady_seconds(artifact, images[:b]))
    return {name: {b: statistics.median(ts) for b, ts in per.items()} for name, per in times.items()}


def steady_seconds(artifact: LoadedArtifact, x: torch.Tensor) -> float:
    """Seconds per call of `artifact` on `x` once it runs steadily, as a busy server calls it: calls for
    BLOCK_S / 2 untimed, then the calls of the next BLOCK_S / 2 (at least one) timed. The runtimes share one
    process and two cores: a runtime's thread pool sleeps while another is timed and spins a while after its
    own last call, so a few calls timed right after a switch measure the switch. Measured (a 28 px ResNet-18,
    2 cores of an AVX-512-bf16 EPYC, 2026-12-06): five batch-1 calls per round put the int8 .pt2 at 0.87-10.9 ms
    and OpenVINO at 0.90-2.8 ms, against 0.68-0.73 and 0.35-0.44 ms each alone in its process; these blocks
    give 0.70-0.74 and 0.35-0.46 ms."""
    end = time.perf_counter() + BLOCK_S / 2
    artifact(x)
    while time.perf_counter() < end:
        artifact(x)
    calls, start = 0, time.perf_counter()
    while calls == 0 or time.perf_counter() - start < BLOCK_S / 2:
        artifact(x)
        calls += 1
    return (time.perf_counter() - start) / calls


def choose(seconds: dict[str, dict[int, float]], batches: list[int]) -> dict[str, Any]:
    """The candidate with the best geometric mean over `batches` of (best time at that batch / its time); ties go
    to the one named first (AOTInductor, which needs nothing but torch)."""
    best = {b: min(per[b] for per in seconds.values()) for b in batches}
    scores = {name: statistics.geometric_mean([best[b] / per[b] for b in batches]) for name, per in seconds.items()}
    chosen = max(scores, key=scores.__getitem__)  # max keeps the first of equal scores
    figures = {name: {"score": round(scores[name], 4), "ms_per_batch": {str(b): round(per[b] * 1e3, 3) for b in batches},
                      "images_per_s": {str(b): round(b / per[b], 1) for b in batches}} for name, per in seconds.items()}
    big = max(batches)
    why = (f"{chosen} is the fastest here that passed parity: "
           + ", ".join(f"{name} {per[1] * 1e3:.1f} ms at batch 1, {big / per[big]:.0f} images/s at batch {big}"
                       for name, per in seconds.items()))
    return {"chosen": chosen, "why": why, "rule": "best geometric mean of speed relative to the fastest, at "
            f"batch {' and '.join(map(str, batches))}", "rounds": ROUNDS, "block_s": BLOCK_S, "threads": torch.get_num_threads(),
            "candidates": figures}

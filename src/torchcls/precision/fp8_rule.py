"""Whether one Linear layer's GEMMs pay in FP8 training, from their shape: M (tokens per step through the
layer), K (in features), N (out features) and the scaling recipe. The one place this is decided;
fp8_layers.py applies it to every layer of a model and reports each decision with its reason.

Two sources, in this order:
- a measured table (`--fp8-table`, JSON written by benchmarks/gpu/fp8_gemm.py on a GPU): the speed-up of a
  whole FP8 linear (forward, grad-input and grad-weight GEMMs with their casts, compiled, as torchao runs
  it) over bf16, per (M, K, N, recipe), for the GPU it was measured on. It is used for the layers whose
  (K, N) it measured, at the measured M nearest to the layer's (within a factor of 2), and only on that GPU.
- otherwise torchao's roofline model (torchao/testing/training/roofline_utils.py, re-derived here without
  sympy): the three GEMMs bound by compute or memory traffic, plus the memory traffic of the amax and cast
  kernels each recipe needs. It is a ceiling: torchao's own H100 measurements reach about 0.7-0.95 of it
  for mid-size GEMMs (e.g. M, K, N = 4096, 8192, 16384: 1.39x measured against a 1.47x ceiling; rowwise
  with K = 1024-2048 at M = 8192: 0.65-1.01x against 0.9-1.1x), so a layer is converted only when the
  ceiling is at least ROOFLINE_MIN_SPEEDUP, which leaves room for that shortfall.
Without M (no example batch to measure the tokens), torchao's own H100 size thresholds decide (see
fp8_layers.size_reason).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.io_files import SMALL_JSON_BYTES, read_bytes

ROOFLINE_MIN_SPEEDUP = 1.3  # the ceiling a layer needs (see above: measured speed-ups fall 5-30% short)
MEASURED_MIN_SPEEDUP = 1.05  # a measured gain smaller than this is within run-to-run noise
# --fp8-table: rows of m, k, n, recipe and speed-ups (~10 values each) that benchmarks/gpu/fp8_gemm.py wrote.
TABLE_BOUNDS = JsonBounds(max_bytes=SMALL_JSON_BYTES, max_values=1_000_000, max_depth=8, max_str=4096,
                          allow_nonfinite=True)
TABLE_M_FACTOR = 2.0  # a measured row stands for layers whose M is within this factor of its own
# torchao's efficiency figures (roofline_utils.py): the share of peak that large GEMMs and pointwise kernels
# reach, and the floor of one kernel launch.
GEMM_EFFICIENCY, MEMORY_EFFICIENCY, LAUNCH_S = 0.78, 0.92, 2e-6
BF16_BYTES, FP8_BYTES = 2, 1


@dataclass(frozen=True)
class GpuFigures:
    """Dense peak rates (no sparsity) and memory bandwidth: datasheet figures, as torchao's roofline uses."""

    label: str
    bf16_flops: float
    fp8_flops: float
    bytes_per_s: float


# H100: torchao's figures (2.4 TB/s, the H100 variant its measurements ran on; the SXM datasheet says
# 3.35). H200: the same chip with 4.8 TB/s of HBM3e. B200: torchao's figures.
FIGURES = {"H100": GpuFigures("H100 figures (989/1979 TFLOP/s, 2.4 TB/s)", 989e12, 1979e12, 2.4e12),
           "H200": GpuFigures("H200 figures (989/1979 TFLOP/s, 4.8 TB/s)", 989e12, 1979e12, 4.8e12),
           "B200": GpuFigures("B200 figures (2250/4500 TFLOP/s, 8 TB/s)", 2.25e15, 4.5e15, 8.0e12)}


def figures_for(gpu: str) -> GpuFigures:
    """The figures of the GPU named `gpu` (torch.cuda.get_device_name); H100's for any other or none."""
    for key, figures in FIGURES.items():
        if key in gpu:
            return figures
    where = f"not in the table for {gpu}" if gpu else "no GPU here"
    h100 = FIGURES["H100"]
    return GpuFigures(f"{h100.label}; {where}", h100.bf16_flops, h100.fp8_flops, h100.bytes_per_s)


def _gemm_s(m: int, k: int, n: int, fp8: bool, f: GpuFigures) -> float:
    compute = 2 * m * k * n / (f.fp8_flops if fp8 else f.bf16_flops) / GEMM_EFFICIENCY
    traffic = (m * k + k * n) * (FP8_BYTES if fp8 else BF16_BYTES) + m * n * BF16_BYTES  # output in bf16
    return max(compute, traffic / f.bytes_per_s / MEMORY_EFFICIENCY, LAUNCH_S)


def _cast_s(rows: int, cols: int, role: str, recipe: str, f: GpuFigures) -> float:
    """The amax and cast kernels of one GEMM operand in forward + backward (torchao's kernel list, no fusion
    with the previous op assumed)."""
    numel = rows * cols
    if recipe == "tensorwise":
        to_fp8 = BF16_BYTES * numel + FP8_BYTES * numel
        # amax pass, then one cast for each use (weight) or one cast writing both layouts (activations)
        kernels = [BF16_BYTES * numel, 0, to_fp8, to_fp8] if role == "weight" else \
            [BF16_BYTES * numel, 0, BF16_BYTES * numel + 2 * FP8_BYTES * numel]
    elif role == "weight":  # rowwise: cast, transpose, cast the transpose
        kernels = [BF16_BYTES * numel + FP8_BYTES * numel, 2 * BF16_BYTES * numel, BF16_BYTES * numel + FP8_BYTES * numel]
    else:
        kernels = [2 * BF16_BYTES * numel + FP8_BYTES * numel, BF16_BYTES * numel + FP8_BYTES * numel]
    return sum(max(b / f.bytes_per_s / MEMORY_EFFICIENCY, LAUNCH_S) for b in kernels)


def roofline_speedup(m: int, k: int, n: int, recipe: str, f: GpuFigures) -> float:
    """The ceiling of bf16 time over FP8 time for one linear's forward + backward (three GEMMs)."""
    shapes = ((m, k, n), (m, n, k), (k, m, n))  # output, grad-input, grad-weight
    bf16 = sum(_gemm_s(*s, fp8=False, f=f) for s in shapes)
    fp8 = sum(_gemm_s(*s, fp8=True, f=f) for s in shapes)
    casts = _cast_s(m, k, "input", recipe, f) + _cast_s(k, n, "weight", recipe, f) + \
        _cast_s(m, n, "grad_output", recipe, f)
    return bf16 / (fp8 + casts)


@dataclass
class MeasuredTable:
    """A table of benchmarks/gpu/fp8_gemm.py: rows of m, k, n, recipe and linear_speedup (bf16 time over
    FP8 time, casts included) measured on `gpu`."""

    path: str
    gpu: str
    rows: list[dict[str, Any]]

    @classmethod
    def load(cls, path: str | Path) -> MeasuredTable:
        try:
            data = load_bounded(read_bytes(path, max_bytes=SMALL_JSON_BYTES, what="FP8 measurement table"), TABLE_BOUNDS,
                                str(path))
            rows = [{"m": int(r["m"]), "k": int(r["k"]), "n": int(r["n"]), "recipe": str(r["recipe"]),
                     "linear_speedup": float(r["linear_speedup"])}
                    for r in data["rows"] if r.get("linear_speedup") is not None]
            return cls(str(path), str(data["gpu"]), rows)
        except (OSError, ValueError, KeyError, TypeError, UserError) as e:
            raise UserError(f"--fp8-table {path}: not a table written by benchmarks/gpu/fp8_gemm.py ({e!r}); "
                            "run that script on the GPU to write one, or drop --fp8-table") from None

    def lookup(self, m: int, k: int, n: int, recipe: str) -> dict[str, Any] | None:
        """The measured row for this (K, N, recipe) whose M is nearest to `m`, within TABLE_M_FACTOR."""
        rows = [r for r in self.rows if (r["k"], r["n"], r["recipe"]) == (k, n, recipe)]
        if not rows:
            return None
        best = min(rows, key=lambda r: abs(math.log(r["m"] / m)))
        return best if abs(math.log(best["m"] / m)) <= math.log(TABLE_M_FACTOR) else None


@dataclass
class ShapeRule:
    """The decision for a GEMM shape on one GPU (`gpu`: its name, empty without one) and recipe."""

    recipe: str
    gpu: str = ""
    table: MeasuredTable | None = None

    def describe(self) -> str:
        table = f"measured table {self.table.path} ({self.table.gpu}) where it covers the shape, else " \
            if self.usable_table() else ""
        return f"{table}roofline ceiling >= {ROOFLINE_MIN_SPEEDUP}x ({figures_for(self.gpu).label})"

    def usable_table(self) -> bool:
        return self.table is not None and bool(self.gpu) and self.table.gpu == self.gpu

    def verdict(self, m: int, k: int, n: int) -> tuple[bool, float, str]:
        """(convert, speed-up, reason) for an (M, K) x (K, N) GEMM."""
        shape = f"M={m} tokens, K={k}, N={n}"
        row = self.table.lookup(m, k, n, self.recipe) if self.usable_table() else None
        if row is not None:
            s, ok = row["linear_speedup"], row["linear_speedup"] >= MEASURED_MIN_SPEEDUP
            where = f"measured {s:.2f}x at M={row['m']} on {self.table.gpu} ({self.table.path})"
            return ok, s, (f"pays: {where} >= {MEASURED_MIN_SPEEDUP}x ({shape})" if ok else
                           f"too small for FP8 to pay: {where} < {MEASURED_MIN_SPEEDUP}x ({shape})")
        figures = figures_for(self.gpu)
        s = roofline_speedup(m, k, n, self.recipe, figures)
        ok = s >= ROOFLINE_MIN_SPEEDUP
        where = f"roofline ceiling {s:.2f}x {'>=' if ok else '<'} {ROOFLINE_MIN_SPEEDUP}x ({shape}; {figures.label})"
        return ok, s, f"pays: {where}" if ok else f"too small for FP8 to pay: {where}"

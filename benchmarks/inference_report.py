"""The figures around benchmarks/inference.py's measurements: the GEMM peaks and model FLOPs a path is held
to, the machine record every figure names (CPU, SIMD level, cores, threads, precisions, runtime versions, load
before and after), and the Markdown tables."""

from __future__ import annotations

import statistics
import time

from inference_goals import goals_markdown
from inference_peers import isa_cap_note, versions

PEAK_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 4096), (8192, 512, 2048))


def measure_peaks(rounds: int = 5) -> dict[str, float]:
    """fp32 and bf16 GEMM GFLOP/s: the best of several shapes (M, K, N) through F.linear (oneDNN/MKL; a bf16
    `a @ b` takes a slow generic path), each the median of interleaved rounds in this process. One 1024³
    GEMM was not the machine's peak: ONNX Runtime's convolutions ran at 132% of it on an AVX2 EPYC. Still a
    measured bound, not a datasheet one: a path may exceed it (the table then says so)."""
    import torch
    from torch.nn.functional import linear

    best = {"fp32": 0.0, "bf16": 0.0}
    for m, k, n in PEAK_SHAPES:
        mats = {name: (torch.randn(m, k).to(dt), torch.randn(n, k).to(dt))
                for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        times: dict[str, list[float]] = {name: [] for name in mats}
        for a, b in mats.values():
            linear(a, b)  # warm-up
        for _ in range(rounds):
            for name, (a, b) in mats.items():
                t = time.perf_counter()
                linear(a, b)
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            best[name] = max(best[name], 2 * m * k * n / statistics.median(ts) / 1e9)
    return best


def add_ratios(rows: list[dict], gflop: float, peaks: dict[str, float]) -> None:
    by = {r["config"]: r for r in rows}
    for r in rows:
        r["b16_img_s"] = 16 / r["b16_ms"] * 1e3
        if "eager" in by:
            r["b16_vs_eager"] = by["eager"]["b16_ms"] / r["b16_ms"]
            r["b1_vs_eager"] = by["eager"]["b1_ms"] / r["b1_ms"]
        if "ort" in by:
            r["b16_vs_ort"] = by["ort"]["b16_ms"] / r["b16_ms"]
            r["b1_vs_ort"] = by["ort"]["b1_ms"] / r["b1_ms"]
        if r.get("precision") in peaks:  # no int8 peak is measured
            r["peak"] = r["precision"]
            r["fraction_of_peak_b16"] = gflop * 16 / (r["b16_ms"] / 1e3) / peaks[r["peak"]]


def markdown(rows: list[dict], peaks: dict[str, float], threads: int) -> str:
    def f(r, k, fmt):
        return format(r[k], fmt) if k in r else "–"

    lines = ["| model | path | precision | b1 ms | b16 ms | b16 img/s | b16 × eager | b16 × ORT | b1 × ORT "
             "| of peak (b16) | top-1 agree |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        of_peak = f"{r['fraction_of_peak_b16']:.0%} {r['peak']}" if "peak" in r else "–"
        lines.append(f"| {r['model']} | {r['config']} | {r.get('precision', '?')} | {r['b1_ms']:.1f} | "
                     f"{r['b16_ms']:.0f} | {r['b16_img_s']:.1f} | {f(r, 'b16_vs_eager', '.2f')} | "
                     f"{f(r, 'b16_vs_ort', '.2f')} | {f(r, 'b1_vs_ort', '.2f')} | {of_peak} | "
                     f"{f(r, 'top1_agreement', '.3f')} |")
    lines.append(f"\nPeaks measured in this run: fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s "
                 f"(the best of GEMMs {', '.join('x'.join(map(str, s)) for s in PEAK_SHAPES)}, {threads} threads)"
                 + ("; paths above 100% beat the best GEMM measured here." if any(
                     r.get("fraction_of_peak_b16", 0) > 1 for r in rows) else "."))
    lines.append(f"Every path ran with {threads} threads (torch.set_num_threads, ORT intra_op_num_threads, "
                 "OpenVINO INFERENCE_NUM_THREADS). How each path was configured:")
    lines += [f"- {c}: {h}" for c, h in dict.fromkeys((r["config"], r.get("how", "")) for r in rows) if h]
    return "\n".join(lines)


def machine_record(precisions: set[str], threads: int, load_before: tuple, load_after: tuple) -> dict:
    """torchcls.machine's record, with the precisions measured, whether bf16 was native or emulated, the runtime
    versions, the thread count every path used, and the load average (1, 5, 15 min) before and after."""
    from torchcls.machine import describe_machine
    from torchcls.precision.hardware import cpu_bf16_here

    native, why = cpu_bf16_here()
    return describe_machine(", ".join(sorted(precisions))) | {
        "bf16_native": native, "bf16_reason": why, "runtimes": versions(), "threads_every_path": threads,
        "isa_cap": isa_cap_note(),
        "load_before": [round(v, 2) for v in load_before], "load_after": [round(v, 2) for v in load_after]}


def machine_line(machine: dict) -> str:
    from torchcls.machine import machine_line as line

    runtimes = ", ".join(f"{k} {v}" for k, v in machine["runtimes"].items() if v)
    load = f"load average {machine['load_before'][0]:.2f} before, {machine['load_after'][0]:.2f} after"
    return (line(machine) + ("" if machine["bf16_native"] else "; bf16 emulated")
            + f"; every path {machine['threads_every_path']} threads; {runtimes}; {load}")


QUIET_LOAD = 0.5  # load average above which figures are not a quiet machine's (STACK.md: 4-8x slower, ratios flip)


def report(result: dict) -> str:
    machine = result["machine"]
    parts = [f"Machine: {machine_line(machine)}"]
    if max(machine["load_before"][0], machine["load_after"][0]) > QUIET_LOAD:
        parts.append(f"**Not a quiet machine** (load average above {QUIET_LOAD}): these figures are not comparable.")
    if machine.get("isa_cap"):
        parts.append(machine["isa_cap"])
    parts.append(markdown(result["rows"], result["peaks_gflops"], result["threads"]))
    parts += [f"Skipped {c}: {why}" for c, why in result["skipped"].items()]
    if result["goals"]:
        parts.append(goals_markdown(result["goals"]))
    return "\n\n".join(parts)

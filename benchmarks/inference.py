"""Inference latency (batch 1) and throughput (batch 16) of every torchcls inference path, at 224 px.

Paths: eager, eager channels_last, torchcls compile (fp32, bf16: `compile_for_inference`),
AOTInductor package (fp32) and ONNX Runtime (fp32), for resnet18, resnet50, mobilenetv3,
convnext_tiny and vit_small. Models are randomly initialised (nothing is downloaded).

One process per configuration (compiled variants interfere inside one process); all of a model's
processes are prepared first, then measured in interleaved rounds (A B C ... A B C ...), and the
figures are medians over rounds. Ratios compare against eager and ONNX Runtime measured in the
same run; "peak" is the best fp32 / bf16 GEMM GFLOP/s over a few shapes, measured in the same run too.
Top-1 agreement and max |Δlogit| (torchcls.artifacts.parity.compare) are against eager fp32 on 32
fixed random inputs (random-init nets have near-tied logits, so this is a strict test).
Prints JSON, then a Markdown table.

    python benchmarks/inference.py --models resnet18 --quick
    python benchmarks/inference.py            # all five models: long on a CPU (compiles ~1 min each)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {"resnet18": "resnet18", "resnet50": "resnet50", "mobilenetv3": "mobilenetv3_large_100",
          "convnext_tiny": "convnext_tiny", "vit_small": "vit_small_patch16_224"}
CONFIGS = ("eager", "eager_cl", "compile_fp32", "compile_bf16", "aoti", "ort")
BATCHES = (1, 16)
SIZE = 224


# ---------------------------------------------------------------- worker: one configuration
def build_runner(model_name: str, config: str, workdir: Path):
    import torch

    from torchcls.data import Preprocess
    from torchcls.models import ModelSpec, create_model

    torch.manual_seed(0)
    model = create_model(ModelSpec(MODELS[model_name], 1000, 3, SIZE)).eval()
    if config in ("eager", "eager_cl"):
        fmt = torch.channels_last if config == "eager_cl" else torch.contiguous_format
        model = model.to(memory_format=fmt)
        return lambda x: model(x.contiguous(memory_format=fmt))
    if config.startswith("compile"):
        from torchcls.artifacts import compile_for_inference

        return compile_for_inference(model, torch.randn(1, 3, SIZE, SIZE), "cpu", config.split("_")[1],
                                     max_batch=16, buckets=BATCHES)
    from torchcls.artifacts.exporter import capture
    from torchcls.artifacts.targets import aoti, onnx
    from torchcls.artifacts.targets.base import ArtifactInfo

    target = aoti if config == "aoti" else onnx
    info = ArtifactInfo(model_name, target.TARGET.name, [str(i) for i in range(1000)],
                        Preprocess(SIZE, 3, (0.5,) * 3, (0.5,) * 3), 16, "fp32")
    path = workdir / f"{model_name}{target.TARGET.suffix}"
    target.build(capture(model, info), info, path, {})
    return target.TARGET.load(path)


def worker(model_name: str, config: str) -> None:
    """Prepare, say "ready", then answer measurement requests on stdin (one JSON line each)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = build_runner(model_name, config, Path(tmp))
        with torch.no_grad():
            for b in BATCHES:  # warm-up: compile each batch bucket, fault in memory
                run(torch.randn(b, 3, SIZE, SIZE))
                run(torch.randn(b, 3, SIZE, SIZE))
            g = torch.Generator().manual_seed(1)
            probe = torch.randn(32, 3, SIZE, SIZE, generator=g)
            logits = torch.cat([run(probe[i:i + 16]).float() for i in range(0, 32, 16)])
        _reply({"ready": True, "prepare_s": time.perf_counter() - t0, "logits": logits.tolist()})
        for line in sys.stdin:
            req = json.loads(line)
            x = torch.randn(req["batch"], 3, SIZE, SIZE)
            times = []
            with torch.no_grad():
                for _ in range(req["iters"]):
                    t = time.perf_counter()
                    run(x)
                    times.append(time.perf_counter() - t)
            _reply({"times": times})


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------- parent: orchestration
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


def model_gflop(model_name: str) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from torchcls.models import ModelSpec, create_model

    model = create_model(ModelSpec(MODELS[model_name], 1000, 3, SIZE)).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, SIZE, SIZE))
    return counter.get_total_flops() / 1e9


class Worker:
    def __init__(self, model_name: str, config: str):
        self.config = config
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", model_name, config],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.config} died (exit {self.proc.wait()})")
        return json.loads(line)

    def measure(self, batch: int, iters: int) -> list[float]:
        self.proc.stdin.write(json.dumps({"batch": batch, "iters": iters}) + "\n")
        self.proc.stdin.flush()
        return self._read()["times"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def bench_model(model_name: str, configs: list[str], rounds: int, iters: dict[int, int]) -> list[dict]:
    import torch

    from torchcls.artifacts.parity import compare

    workers = []
    try:
        for c in configs:  # prepared one at a time: compiles do not compete with each other
            print(f"[{model_name}] preparing {c} ...", file=sys.stderr, flush=True)
            workers.append(Worker(model_name, c))
        samples = {(w.config, b): [] for w in workers for b in BATCHES}
        for r in range(rounds):
            order = workers[r % len(workers):] + workers[:r % len(workers)]  # rotate who goes first
            for w in order:
                for b in BATCHES:
                    samples[(w.config, b)].append(statistics.median(w.measure(b, iters[b])))
    finally:
        for w in workers:
            w.close()
    ref = torch.tensor(workers[0].ready["logits"]) if configs[0] == "eager" else None
    rows = []
    for w in workers:
        logits = torch.tensor(w.ready["logits"])
        row = {"model": model_name, "config": w.config, "prepare_s": round(w.ready["prepare_s"], 1),
               "b1_ms": statistics.median(samples[(w.config, 1)]) * 1e3,
               "b16_ms": statistics.median(samples[(w.config, 16)]) * 1e3}
        if ref is not None:
            parity = compare(ref, logits)
            row["top1_agreement"], row["max_abs_diff"] = parity["top1_agreement"], parity["max_abs_diff"]
        rows.append(row)
    return rows


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
        peak = "bf16" if r["config"].endswith("bf16") else "fp32"
        r["peak"] = peak
        r["fraction_of_peak_b16"] = gflop * 16 / (r["b16_ms"] / 1e3) / peaks[peak]


def markdown(rows: list[dict], peaks: dict[str, float]) -> str:
    def f(r, k, fmt):
        return format(r[k], fmt) if k in r else "–"

    lines = ["| model | path | b1 ms | b16 ms | b16 img/s | b16 × eager | b16 × ORT | b1 × ORT | of peak (b16) "
             "| top-1 agree |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['config']} | {r['b1_ms']:.1f} | {r['b16_ms']:.0f} | "
                     f"{r['b16_img_s']:.1f} | {f(r, 'b16_vs_eager', '.2f')} | {f(r, 'b16_vs_ort', '.2f')} | "
                     f"{f(r, 'b1_vs_ort', '.2f')} | {r['fraction_of_peak_b16']:.0%} {r['peak']} | "
                     f"{f(r, 'top1_agreement', '.3f')} |")
    lines.append(f"\nPeaks measured in this run: fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s "
                 f"(the best of GEMMs {', '.join('x'.join(map(str, s)) for s in PEAK_SHAPES)}, {os.cpu_count()} CPUs)"
                 + ("; paths above 100% beat the best GEMM measured here." if any(
                     r["fraction_of_peak_b16"] > 1 for r in rows) else "."))
    return "\n".join(lines)


def machine_record(configs: list[str]) -> dict:
    """torchcls.machine's record, with the precisions measured and whether bf16 was native or emulated."""
    from torchcls.machine import describe_machine
    from torchcls.precision.hardware import cpu_bf16_here

    native, why = cpu_bf16_here()
    precisions = ", ".join(sorted({"bf16" if c.endswith("bf16") else "fp32" for c in configs}))
    return describe_machine(precisions) | {"bf16_native": native, "bf16_reason": why}


def machine_line(machine: dict) -> str:
    from torchcls.machine import machine_line as line

    return line(machine) + ("" if machine["bf16_native"] else "; bf16 emulated")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (default: 5)")
    p.add_argument("--quick", action="store_true", help="3 rounds, fewer iterations per round")
    p.add_argument("--out", help="also write <out>.json and <out>.md")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    for name, known in (("model", MODELS), ("config", CONFIGS)):
        bad = [v for v in (models if name == "model" else configs) if v not in known]
        if bad:
            sys.exit(f"unknown {name}(s): {', '.join(bad)}; choose from {', '.join(known)}")
    rounds, iters = (3, {1: 5, 16: 2}) if args.quick else (args.rounds, {1: 10, 16: 3})
    # Inductor's caches and temp files stay inside one folder that is removed at the end.
    with tempfile.TemporaryDirectory(prefix="torchcls-bench-") as scratch:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(scratch) / "inductor"))
        os.environ["TMPDIR"] = scratch
        peaks = measure_peaks()
        rows = []
        for m in models:
            model_rows = bench_model(m, configs, rounds, iters)
            add_ratios(model_rows, model_gflop(m), peaks)
            rows += model_rows
    result = {"size": SIZE, "batches": list(BATCHES), "rounds": rounds, "iters": iters, "peaks_gflops": peaks,
              "threads": os.cpu_count(), "machine": machine_record(configs), "rows": rows}
    print(json.dumps(result, indent=2))
    table = f"Machine: {machine_line(result['machine'])}\n\n" + markdown(rows, peaks)
    print(table)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=2))
        Path(f"{args.out}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()

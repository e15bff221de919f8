"""Inference latency (batch 1) and throughput (batch 16) of every torchcls inference path and of its peers, at 224 px.

torchcls paths: eager, eager channels_last, torchcls compile (fp32, bf16: `compile_for_inference`), AOTInductor
package (fp32), AOTInductor static int8 (`aoti_int8`: `torchcls export --precision int8`, calibrated on the same
inputs as ORT's int8; 7-bit activations where the CPU's int8 kernels lack VNNI, as export builds it), and
`default`: what `torchcls export CHECKPOINT` builds on this machine with every option at its default (target,
precision auto with its fallback to fp32 when the reduced precision fails parity on the probe; `torchcls serve`
serves that artifact as it was exported). Peers, each from the same ONNX file (torchcls' onnx
target): ONNX Runtime fp32 (`ort`), ONNX Runtime int8 (`ort_int8`: static QDQ quantization, only where the CPU
has VNNI), OpenVINO with PERFORMANCE_HINT THROUGHPUT (`ov_throughput`: b16 through an AsyncInferQueue of its
optimal request count) and LATENCY (`ov_latency`), OpenVINO in its default inference precision. Every path runs
with the same thread count (--threads: torch.set_num_threads, ORT intra_op_num_threads, OpenVINO
INFERENCE_NUM_THREADS). A peer that cannot run here (openvino not installed, no VNNI) is skipped with a line
saying why. Models: resnet18, resnet50, mobilenetv3, convnext_tiny, vit_small, randomly initialised (nothing
is downloaded), or a trained checkpoint (`--checkpoint RUN`: its own model, input size and held-out images;
benchmarks/inference_source.py).

One process per configuration (compiled variants interfere inside one process); all of a model's
processes are prepared first, then measured in interleaved rounds (A B C ... A B C ...), and the
figures are medians over rounds. Ratios compare against eager and ONNX Runtime measured in the
same run; "peak" is the best fp32 / bf16 GEMM GFLOP/s over a few shapes, measured in the same run too.
Top-1 agreement and max |Δlogit| (torchcls.artifacts.parity.compare) are against eager fp32 on 32
fixed random inputs (random-init nets have near-tied logits, so this is a strict test); int8 calibrates on
other random inputs. With `--checkpoint`: on up to 256 of its held-out images, int8 calibrated on its training
images. Per model, `goals` holds the default path against the fastest peer (issue 31: b16
throughput >= 1.2x, b1 latency <= 0.9x, agreement >= 99%; benchmarks/inference_goals.py). The machine
record names the CPU, SIMD level, cores, threads, precisions, runtime versions and the load average before
and after. Prints JSON, then Markdown tables.

    python benchmarks/inference.py --models resnet18 --quick
    python benchmarks/inference.py --models resnet18,resnet50,mobilenetv3   # issue 31's three models
    python benchmarks/inference.py            # all five models: long on a CPU (compiles ~1 min each)
    python benchmarks/inference.py --checkpoint runs/mine --configs default,ort,ort_int8,ov_throughput,ov_latency
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
from dataclasses import replace
from pathlib import Path

from inference_goals import goal_summary
from inference_peers import (
    OV_HINTS,
    OpenVinoRunner,
    default_export_request,
    ort_int8_runner,
    skip_reason,
)
from inference_report import add_ratios, machine_record, measure_peaks, report
from inference_source import MODELS, SIZE, Source

CONFIGS = ("eager", "eager_cl", "compile_fp32", "compile_bf16", "aoti", "aoti_int8", "default", "ort", "ort_int8",
           "ov_throughput", "ov_latency")
BATCHES = (1, 16)


# ---------------------------------------------------------------- worker: one configuration
def logits_of(run, x):
    import torch

    with torch.no_grad():
        return torch.cat([run(x[i:i + 16]).float() for i in range(0, len(x), 16)])


def shared_onnx(source: Source, model, shared: Path) -> Path:
    """The fp32 ONNX file (torchcls' onnx target, batch 1-16) every ONNX peer reads: built by the first worker
    that needs it (workers are prepared one at a time), under a temporary name, then renamed."""
    from torchcls.artifacts.exporter import capture
    from torchcls.artifacts.targets import onnx

    stem = Path(source.name).name
    path = shared / f"{stem}.onnx"
    if not path.exists():
        info = source.info("onnx", 16, "fp32")
        tmp = shared / f"{stem}.partial.onnx"
        onnx.build(capture(model, info), info, tmp, {})
        os.replace(tmp, path)
    return path


def default_runner(source: Source, model, workdir: Path):
    """What `torchcls export` builds by default here: --target auto's candidates (torchcls.artifacts.fastest),
    each with the exporter's precision rule (auto falls back to fp32 when the reduced precision fails parity,
    here on the probe), timed and chosen by the exporter's own rule; the winner runs. For a checkpoint:
    exported_default."""
    import copy

    import torch

    from torchcls.artifacts.exporter import capture, graph_info
    from torchcls.artifacts.fastest import candidates, choose, time_artifacts
    from torchcls.artifacts.parity import DEFAULT_MIN_AGREEMENT, compare

    probe = source.probe()
    ref = logits_of(model, probe)
    built, labels, notes = {}, {}, {}
    for c in candidates(torch.device("cpu"))[0]:
        tgt, req, choice = default_export_request(c.target, c.runtime)
        reason = "static int8, X86InductorQuantizer" if c.precision == "int8" else choice.reason
        # int8 is a candidate of its own: one that fails parity is not kept (the others include fp32)
        for attempt in (c.precision,) if c.precision else dict.fromkeys((req.precision, "fp32")):
            req = replace(req, precision=attempt)
            plan = int8_plan(source) if attempt == "int8" else tgt.plan(req, None)
            info = replace(source.info(tgt.name, req.max_batch, attempt), runtime=c.runtime or "")
            path = workdir / f"default-{c.name}-{attempt}{tgt.suffix}"
            plan.build(capture(copy.deepcopy(model), graph_info(info)), info, path, {})
            run = tgt.load(path)
            agreement = compare(ref, logits_of(run, probe))["top1_agreement"]
            need = plan.min_agreement if plan.min_agreement is not None else DEFAULT_MIN_AGREEMENT[attempt]
            if agreement >= need or attempt == "fp32":
                break
            reason += f"; {attempt} failed parity here ({agreement:.1%} < {need:.1%}): fp32 instead, as export does"
        if c.precision and agreement < need:
            notes[c.name] = f"{c.name} not kept: parity {agreement:.1%} < {need:.1%} on the probe, as export does"
            continue
        built[c.name], labels[c.name] = run, f"{c.target}-{plan.label}"
        notes[c.name] = f"{labels[c.name]} ({reason})"
    picked = choose(time_artifacts(built, list(BATCHES)), list(BATCHES))
    run = built[picked["chosen"]]
    run.bench_info = {"runtime": run.info.runtime or "torch", "precision": run.info.precision,
                      "path": labels[picked["chosen"]], "reason": picked["why"],
                      "how": f"`torchcls export` defaults (--target auto): {picked['why']}; candidates: "
                             + "; ".join(notes.values())}
    return run


def exported_default(source: Source, workdir: Path):
    """`torchcls export CHECKPOINT` with every option at its default (into `workdir`), loaded: the artifact it
    chose, with its choice record."""
    from torchcls.artifacts import export, load_artifact

    result = export(source.checkpoint, out=workdir / "default")
    run = load_artifact(result.path)
    choice = result.parity["choice"]
    run.bench_info = {"runtime": run.info.runtime or "torch", "precision": run.info.precision,
                      "path": f"{run.info.target}-{run.info.precision}", "reason": choice["why"],
                      "how": f"`torchcls export CHECKPOINT` (defaults): {choice['why']}; parity "
                             f"{result.parity['top1_agreement']:.1%} on {result.parity['n']} held-out images"}
    return run


def int8_plan(source: Source):
    """`torchcls export --precision int8`'s plan, calibrated on the source's calibration inputs."""
    from torchcls.artifacts.quantize import AOTI_INT8_MIN_AGREEMENT
    from torchcls.artifacts.targets import aoti
    from torchcls.artifacts.targets.base import Plan

    return Plan("int8", aoti.int8_builder(source.calibration()), AOTI_INT8_MIN_AGREEMENT)


def build_runner(source: Source, config: str, workdir: Path, shared: Path, threads: int):
    import torch

    if config == "default" and source.checkpoint is not None:
        return exported_default(source, workdir)
    model = source.model()
    if config == "default":
        return default_runner(source, model, workdir)
    if config in ("ort", "ort_int8") or config in OV_HINTS:
        onnx_path = shared_onnx(source, model, shared)
        if config == "ort_int8":
            return ort_int8_runner(onnx_path, workdir, threads, source.calibration(), source.calibration_note())
        if config in OV_HINTS:
            return OpenVinoRunner(onnx_path, OV_HINTS[config], threads, BATCHES, source.shape(1)[1:])
        from torchcls.artifacts.targets import onnx

        return onnx.TARGET.load(onnx_path)  # intra_op_num_threads = torch's thread count, set by the worker
    if config in ("eager", "eager_cl"):
        fmt = torch.channels_last if config == "eager_cl" else torch.contiguous_format
        model = model.to(memory_format=fmt)
        return lambda x: model(x.contiguous(memory_format=fmt))
    if config.startswith("compile"):
        from torchcls.artifacts import compile_for_inference

        return compile_for_inference(model, torch.randn(*source.shape(1)), "cpu", config.split("_")[1],
                                     max_batch=16, buckets=BATCHES)
    from torchcls.artifacts.exporter import capture
    from torchcls.artifacts.targets import aoti

    precision = "int8" if config == "aoti_int8" else "fp32"
    info = source.info("aoti", 16, precision)
    path = workdir / f"model-{precision}.pt2"
    build = int8_plan(source).build if precision == "int8" else aoti.build
    build(capture(model, replace(info, precision="fp32")), info, path, {})
    return aoti.TARGET.load(path)


def describe_runner(source: Source, config: str, run, threads: int) -> dict:
    """How a path is configured: the runner's own account (peers, default), else from its name."""
    own = getattr(run, "bench_info", None)
    if own is not None:
        return dict(own)
    runtime = "onnxruntime" if config == "ort" else "torch"
    how = {"ort": f"CPUExecutionProvider, intra_op_num_threads={threads}", "aoti": "AOTInductor, frozen",
           "eager_cl": "channels_last"}.get(config, "torch.compile, frozen" if config.startswith("compile") else "")
    if config == "aoti_int8":
        how = f"AOTInductor, frozen, PT2E static int8 (X86InductorQuantizer; {source.calibration_note()})"
    precision = "bf16" if config.endswith("bf16") else "int8" if config.endswith("int8") else "fp32"
    return {"runtime": runtime, "precision": precision, "how": how}


def time_calls(run, x, iters: int) -> list[float]:
    import torch

    timed = getattr(run, "timed", None)
    with torch.no_grad():
        if timed is not None:  # a runner that keeps several requests in flight measures itself
            return timed(x, iters)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - t)
        return times


def worker(model_name: str, config: str, threads: int, shared: str) -> None:
    """Prepare, say "ready", then answer measurement requests on stdin (one JSON line each)."""
    import torch

    global _REPLIES
    # Replies go to the parent on the original stdout; anything else printed to stdout (`torchcls export`'s
    # progress, a compiler's output) goes to stderr and cannot break a reply line.
    _REPLIES = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(threads)
    source = Source(model_name)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = build_runner(source, config, Path(tmp), Path(shared), threads)
        with torch.no_grad():
            for b in BATCHES:  # warm-up: compile each batch bucket, fault in memory
                run(torch.randn(*source.shape(b)))
                run(torch.randn(*source.shape(b)))
        logits = logits_of(run, source.probe())
        _reply({"ready": True, "prepare_s": time.perf_counter() - t0, "logits": logits.tolist(),
                "info": describe_runner(source, config, run, threads)})
        for line in sys.stdin:
            req = json.loads(line)
            _reply({"times": time_calls(run, torch.randn(*source.shape(req["batch"])), req["iters"])})


_REPLIES = sys.stdout


def _reply(obj: dict) -> None:
    _REPLIES.write(json.dumps(obj) + "\n")
    _REPLIES.flush()


# ---------------------------------------------------------------- parent: orchestration
class Worker:
    def __init__(self, model_name: str, config: str, threads: int, shared: Path):
        self.config = config
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", model_name, config, str(threads),
                                      str(shared)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def bench_model(model_name: str, configs: list[str], rounds: int, iters: dict[int, int], threads: int,
                shared: Path) -> list[dict]:
    import torch

    from torchcls.artifacts.parity import compare

    workers = []
    try:
        for c in configs:  # prepared one at a time: compiles do not compete with each other
            print(f"[{model_name}] preparing {c} ...", file=sys.stderr, flush=True)
            workers.append(Worker(model_name, c, threads, shared))
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
    rows, label = [], Source(model_name).label  # a checkpoint's label reads its metadata: once
    for w in workers:
        logits = torch.tensor(w.ready["logits"])
        row = {"model": label, "config": w.config, "prepare_s": round(w.ready["prepare_s"], 1),
               "b1_ms": statistics.median(samples[(w.config, 1)]) * 1e3,
               "b16_ms": statistics.median(samples[(w.config, 16)]) * 1e3} | w.ready["info"]
        if ref is not None:
            parity = compare(ref, logits)
            row["top1_agreement"], row["max_abs_diff"] = parity["top1_agreement"], parity["max_abs_diff"]
            row["probe_images"] = len(logits)
        rows.append(row)
    return rows


def runnable(configs: list[str]) -> tuple[list[str], dict[str, str]]:
    skipped = {c: why for c in configs if (why := skip_reason(c))}
    for c, why in skipped.items():
        print(f"skipped {c}: {why}", file=sys.stderr, flush=True)
    return [c for c in configs if c not in skipped], skipped


def parse_args() -> argparse.Namespace:
    from torchcls.machine import cpu_budget

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--checkpoint", metavar="RUN",
                   help="a trained run dir or .safetensors instead of --models' random weights: its input size, "
                        "held-out images as the agreement probe, training images as int8 calibration, and "
                        "`torchcls export RUN` as the default path")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (default: 5)")
    p.add_argument("--quick", action="store_true", help="3 rounds, fewer iterations per round")
    p.add_argument("--threads", type=int, default=cpu_budget().usable,
                   help="threads of every path (default: the CPUs this process may use)")
    p.add_argument("--out", help="also write <out>.json and <out>.md")
    p.add_argument("--worker", nargs=4, metavar=("MODEL", "CONFIG", "THREADS", "SHARED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return args
    args.models = [m for m in args.models.split(",") if m]
    args.configs = [c for c in args.configs.split(",") if c]
    if args.checkpoint:
        if not Path(args.checkpoint).exists():
            sys.exit(f"--checkpoint {args.checkpoint}: no such run dir or file")
        args.models = [str(Path(args.checkpoint).resolve())]
    for name, given, known in (("config", args.configs, CONFIGS),) + (
            () if args.checkpoint else (("model", args.models, MODELS),)):
        bad = [v for v in given if v not in known]
        if bad:
            sys.exit(f"unknown {name}(s): {', '.join(bad)}; choose from {', '.join(known)}")
    if args.threads < 1:
        sys.exit("--threads must be at least 1")
    if "eager" not in args.configs:  # the reference of every path's top-1 agreement and of "× eager"
        print("measuring eager too: it is the reference of every path's top-1 agreement", file=sys.stderr)
        args.configs.insert(0, "eager")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        model, config, threads, shared = args.worker
        return worker(model, config, int(threads), shared)
    import torch

    torch.set_num_threads(args.threads)  # the GEMM peaks with the paths' thread count
    configs, skipped = runnable(args.configs)
    rounds, iters = (3, {1: 5, 16: 2}) if args.quick else (args.rounds, {1: 10, 16: 3})
    load_before = os.getloadavg()
    # Inductor's caches and temp files stay inside one folder that is removed at the end.
    with tempfile.TemporaryDirectory(prefix="torchcls-bench-") as scratch:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(scratch) / "inductor"))
        os.environ["TMPDIR"] = scratch
        shared = Path(scratch) / "onnx"
        shared.mkdir()
        peaks = measure_peaks()
        rows = []
        for m in args.models:
            model_rows = bench_model(m, configs, rounds, iters, args.threads, shared)
            add_ratios(model_rows, Source(m).gflop(), peaks)
            rows += model_rows
    machine = machine_record({r["precision"] for r in rows}, args.threads, load_before, os.getloadavg())
    goals = goal_summary(rows)
    size = Source(args.models[0]).shape(1)[-1] if args.checkpoint else SIZE
    result = {"size": size, "checkpoint": args.checkpoint, "batches": list(BATCHES), "rounds": rounds,
              "iters": iters, "peaks_gflops": peaks, "threads": args.threads, "machine": machine, "skipped": skipped,
              "rows": rows, "goals": goals}
    print(json.dumps(result, indent=2))
    table = report(result)
    print(table)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=2))
        Path(f"{args.out}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()

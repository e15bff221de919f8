"""The one device check: every CUDA path of torchcls on one GPU, one JSON and one Markdown table with
pass/fail and figures. Run through check.sh (which picks the project's .venv).

    bash benchmarks/gpu/check.sh --dry-run                 # the steps, parts and budgets as one JSON object
    bash benchmarks/gpu/check.sh --out gpu-check           # on a GPU machine: gpu-check/check.json, check.md
    bash benchmarks/gpu/check.sh --part 1 --out gpu-check  # half of it: each part fits one 10-minute call

The budgets were measured on an H200 (torch 2.11): all steps take about 13 minutes, more than one call of
a 15-minute device lease allows, so they come in two parts of at most PART_BUDGET_S each: part 1 runs
one process (training steps, FP8, the allocator report, the CUDA export, its latency and served
throughput), part 2 the torchrun jobs and the compile gains. Each step is a subprocess with its own
timeout (its budget, or what is left of the call's if less); a step that overruns is killed (its whole
process group) and recorded as failed, and once the call's budget is spent the remaining steps are
recorded as skipped. Steps that need an earlier step's output (the export needs the memory-report
run's checkpoint) are skipped, with the reason, when that step failed. Training figures are
synthetic-batch step throughput through torchcls's own precision code (steps.py); the distributed,
memory, export and compile steps run the torchcls CLI itself.

This module imports nothing beyond the standard library, so --dry-run needs no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PART_BUDGET_S = 540  # each part fits one call on a 15-minute device lease (10-minute command limit), start-up aside
MIN_STEP_S = 10  # a step is not started with less time left than this


@dataclass
class Ctx:
    out: Path
    py: str
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def torchcls(self, *args: str) -> list[str]:
        return [self.py, "-m", "torchcls", *args]

    def torchrun(self, *args: str) -> list[str]:
        return [self.py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "torchcls",
                *args]

    def step(self, name: str, *args: str, tag: str | None = None) -> list[str]:
        """A measurement of steps.py; it writes <tag or name>.json into the output folder."""
        return [self.py, str(HERE / "steps.py"), name, "--json", str(self.out / f"{tag or name}.json"), *args]

    def runs(self) -> Path:
        return self.out / "runs"


@dataclass
class Step:
    name: str
    budget_s: int
    what: str
    commands: Callable[[Ctx], list[list[str]]]
    needs: tuple[str, ...] = ()
    figures: Callable[[Ctx], dict[str, Any]] = lambda ctx: {}
    part: int = 1  # 1: one process, compute and export; 2: torchrun jobs and compile gains (env is in both)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _step_json(name: str) -> Callable[[Ctx], dict[str, Any]]:
    return lambda ctx: _json(ctx.out / f"{name}.json")


TRAIN_DATA = ("--data", "mnist-5k", "--channels", "3", "--epochs", "1", "--workers", "8", "--no-progress")


def _memory_figures(ctx: Ctx) -> dict[str, Any]:
    report = _json(ctx.runs() / "mem" / "allocator.json")
    alloc = report.get("allocator", {})
    keys = ("allocated_peak_bytes", "reserved_peak_bytes", "fragmentation_pct_max", "num_alloc_retries", "num_ooms")
    snap = ctx.runs() / "mem" / "memory_snapshot.pickle"
    return {k: alloc.get(k) for k in keys} | {"snapshot_bytes": snap.stat().st_size if snap.exists() else None,
                                                "advice": alloc.get("advice")}


def _resume_figures(name: str) -> Callable[[Ctx], dict[str, Any]]:
    def figures(ctx: Ctx) -> dict[str, Any]:
        run = ctx.runs() / name
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
        epochs = [json.loads(x) for x in lines if '"epoch"' in x and '"val_top1"' in x]
        return {"dcp": (run / "checkpoints" / "last.dcp").exists(), "epochs_recorded": len(epochs),
                "val_top1": [e.get("val_top1") for e in epochs]}
    return figures


def _parity_figures(ctx: Ctx) -> dict[str, Any]:
    p = _json(ctx.out / "export" / "parity.json")
    return {k: p.get(k) for k in ("device", "compute_capability", "gpu", "top1_agreement", "max_abs_diff", "n")}


def _serve_figures(ctx: Ctx) -> dict[str, Any]:
    s = _json(ctx.out / "serve_load.json")
    return {"raw_images_per_s": s.get("raw_images_per_s"), "best_fraction_of_raw": s.get("best_fraction_of_raw"),
            "levels": s.get("levels")}


# timm's published eager vs torch.compile gains (RTX 4090/5090, AMP, batch 1024), set beside ours: same
# backbones, another GPU and batch, so only the order of the gains compares.
TIMM_COMPILE_GAINS = {"resnet50": "1.87-1.95x", "convnext_tiny": "1.39-1.60x", "vit_base_patch16_224": "1.12-1.13x"}


def _median(v: Any) -> Any:
    return v.get("median") if isinstance(v, dict) else v


def _compile_figures(ctx: Ctx) -> dict[str, Any]:
    data = _json(ctx.out / "bench-compile" / "bench_compile.json")
    rows = [{"model": r.get("model"), "batch": r.get("batch"), "status": r.get("status"),
             "speedup": round(r["speedup"], 3) if r.get("speedup") else None,
             "eager_ms": _median(r.get("eager_ms")), "compiled_ms": _median(r.get("compiled_ms")),
             "timm_published": TIMM_COMPILE_GAINS.get(r.get("model")), "error": r.get("error")}
            for r in data.get("results", [])]
    return {"rows": rows}


STEPS = [
    Step("env", 20, "torch, CUDA, GPU name and compute capability", lambda c: [c.step("env")],
         figures=_step_json("env")),
    Step("train_resnet50", 75, "ResNet-50 training step, bf16 autocast, eager vs torch.compile, images/s",
         lambda c: [c.step("train", "--model", "resnet50", "--batch", "128", tag="train_resnet50")],
         figures=_step_json("train_resnet50")),
    Step("train_vit", 55, "ViT-B/16 training step, bf16 autocast, eager vs torch.compile, images/s",
         lambda c: [c.step("train", "--model", "vit_base_patch16_224", "--batch", "128", tag="train_vit")],
         figures=_step_json("train_vit")),
    Step("fp8", 45, "torchao FP8 tensorwise and rowwise vs bf16: step time and loss parity, ViT-H-sized MLP blocks",
         lambda c: [c.step("fp8")], figures=_step_json("fp8")),
    Step("memory_report", 30, "torchcls train --memory-report --memory-snapshot (ResNet-50, bf16): allocator report",
         lambda c: [c.torchcls("train", *TRAIN_DATA, "--model", "resnet50", "--img-size", "224", "--batch-size", "128",
                               "--precision", "bf16", "--device", "cuda", "--memory-report", "--memory-snapshot",
                               "--out-dir", str(c.runs()), "--name", "mem")], figures=_memory_figures),
    Step("ddp_nccl", 55, "torchrun --nproc-per-node 1 DDP over NCCL, then --resume for a second epoch",
         lambda c: [c.torchrun("train", *TRAIN_DATA, "--model", "resnet18", "--img-size", "64", "--parallel", "ddp",
                               "--precision", "bf16", "--out-dir", str(c.runs()), "--name", "ddp"),
                    c.torchrun("train", *TRAIN_DATA[:-3], "--workers", "8", "--no-progress", "--epochs", "2",
                               "--model", "resnet18", "--img-size", "64", "--parallel", "ddp", "--precision", "bf16",
                               "--out-dir", str(c.runs()), "--name", "ddp", "--resume")],
         figures=_resume_figures("ddp"), part=2),
    Step("fsdp2_nccl_dcp", 80, "torchrun FSDP2 over NCCL, DCP save, --resume, consolidate",
         lambda c: [*(c.torchrun("train", *TRAIN_DATA[:-3], "--workers", "8", "--no-progress", "--epochs", str(e),
                                 "--model", "vit_small_patch16_224", "--img-size", "64", "--parallel", "fsdp2",
                                 "--precision", "bf16", "--out-dir", str(c.runs()), "--name", "fsdp2",
                                 *(("--resume",) if e == 2 else ())) for e in (1, 2)),
                    c.torchcls("consolidate", str(c.runs() / "fsdp2"))],
         figures=_resume_figures("fsdp2"), part=2),
    Step("fp8_fsdp_all_gather", 50, "torchrun FSDP2 with --precision fp8 --fp8-fsdp-all-gather, world size 1",
         lambda c: [c.torchrun("train", *TRAIN_DATA, "--model", "vit_small_patch16_224", "--img-size", "64",
                               "--parallel", "fsdp2", "--precision", "fp8", "--fp8-recipe", "tensorwise",
                               "--fp8-fsdp-all-gather", "--fp8-min-dim", "256", "--out-dir", str(c.runs()),
                               "--name", "fp8fsdp")], figures=_resume_figures("fp8fsdp"), part=2),
    Step("export_aoti_cuda", 120, "torchcls export --target aoti --device cuda of the ResNet-50 run, parity.json",
         lambda c: [c.torchcls("export", str(c.runs() / "mem"), "--target", "aoti", "--device", "cuda",
                               "--max-batch", "64", "--parity-images", "256", "--min-agreement", "0.99",
                               "--out", str(c.out / "export" / "model.pt2"))],
         needs=("memory_report",), figures=_parity_figures),
    Step("inference_bench", 40, "the CUDA .pt2 vs eager vs torch.compile: b1 latency, b64 throughput",
         lambda c: [c.step("infer", "--artifact", str(c.out / "export" / "model.pt2"), "--checkpoint",
                           str(c.runs() / "mem"))], needs=("export_aoti_cuda",), figures=_step_json("infer")),
    Step("serve_throughput", 30, "torchcls serve of the CUDA .pt2 (auto device) vs the raw artifact, images/s",
         lambda c: [[c.py, str(REPO / "benchmarks" / "serve_load.py"), str(c.out / "export" / "model.pt2"),
                     "--concurrency", "32", "--seconds", "5", "--rounds", "1", "--max-batch", "64",
                     "--json-out", str(c.out / "serve_load.json")]],
         needs=("export_aoti_cuda",), figures=_serve_figures),
    Step("bench_compile", 190, "torchcls bench compile: resnet50, convnext_tiny, vit_base_patch16_224 at bf16, b64",
         lambda c: [c.torchcls("bench", "compile", "--models", "resnet50,convnext_tiny,vit_base_patch16_224",
                               "--batch", "64", "--precision", "bf16", "--modes", "default", "--device", "cuda",
                               "--repeats", "10", "--timeout", "60", "--out", str(c.out / "bench-compile"))],
         figures=_compile_figures, part=2),
]


def plan() -> dict[str, Any]:
    steps = [{"name": s.name, "budget_s": s.budget_s, "part": "both" if s.name == "env" else s.part} for s in STEPS]
    parts = {str(p): sum(s.budget_s for s in STEPS if s.name == "env" or s.part == p) for p in (1, 2)}
    return {"steps": steps, "parts": parts, "part_budget_s": PART_BUDGET_S,
            "total_budget_s": sum(s["budget_s"] for s in steps)}


def selected(part: str, only: str | None) -> set[str]:
    """The steps one call runs: --only's (and what they need), else a part's or all; env always."""
    if only:
        return with_needs(set(only.split(","))) | {"env"}
    return {s.name for s in STEPS if part == "all" or s.name == "env" or str(s.part) == part}


def with_needs(names: set[str]) -> set[str]:
    """`names` and every step they need, transitively."""
    by_name = {s.name: s for s in STEPS}
    unknown = names - set(by_name)
    if unknown:
        raise SystemExit(f"check.py: --only {','.join(sorted(unknown))}: no such step; steps: {', '.join(by_name)}")
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += by_name[name].needs
    return seen


def run_command(cmd: list[str], timeout: float, log: Path) -> tuple[int | None, float]:
    """(exit code or None on timeout, seconds). The command gets its own process group: on timeout the
    whole group (torchrun's workers, DataLoader workers, compile workers) is killed."""
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env=os.environ | {"PYTHONPATH": _pythonpath(), "PYTHONFAULTHANDLER": "1"})
        try:
            code: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.perf_counter() - start


def _pythonpath() -> str:
    """This checkout's src/ first, then what the caller set (e.g. a folder of wheels installed with --target
    on a machine whose Python is not the project's)."""
    return os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)


def run_step(step: Step, ctx: Ctx, left_s: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": step.name, "what": step.what, "budget_s": step.budget_s}
    failed = [n for n in step.needs if ctx.results.get(n, {}).get("status") != "pass"]
    if failed:
        return entry | {"status": "skipped", "reason": f"needs {', '.join(failed)}, which did not pass"}
    if left_s < MIN_STEP_S:
        return entry | {"status": "skipped", "reason": f"total budget spent ({left_s:.0f} s left)"}
    deadline = time.perf_counter() + min(step.budget_s, left_s)
    log = ctx.out / "logs" / f"{step.name}.log"
    elapsed = 0.0
    for cmd in step.commands(ctx):
        code, secs = run_command(cmd, deadline - time.perf_counter(), log)
        elapsed += secs
        if code != 0:
            why = "timed out" if code is None else f"exit code {code}"
            return entry | {"status": "fail", "seconds": round(elapsed, 1), "reason": f"{why}: {' '.join(cmd[:6])} "
                            f"... (log: {log.relative_to(ctx.out)})", "figures": _safe(step.figures, ctx)}
    return entry | {"status": "pass", "seconds": round(elapsed, 1), "figures": _safe(step.figures, ctx)}


def _safe(fn: Callable[[Ctx], dict[str, Any]], ctx: Ctx) -> dict[str, Any]:
    try:
        return fn(ctx)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {"figures_error": repr(e)}


def _short(figures: dict[str, Any]) -> str:
    """One table cell: the compile rows as 'model bN: gain (timm's)', other figures as compact JSON."""
    if "rows" in figures:
        return "; ".join(f"{r['model']} b{r['batch']}: " + (f"{r['speedup']}x (timm {r['timm_published']})"
                                                          if r.get("speedup") else str(r.get("error"))[:80])
                         for r in figures["rows"])
    shown = _without(figures, ("advice", "levels", "losses"))
    return json.dumps(shown, separators=(",", ":"))[:600] if shown else ""


def _without(value: Any, keys: tuple[str, ...]) -> Any:
    """`value` with `keys` left out at every depth (per-step losses, advice text: in check.json only)."""
    if isinstance(value, dict):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    return value


def markdown(result: dict[str, Any]) -> str:
    env = result["steps"][0].get("figures") or {}
    head = [f"# torchcls device check: {env.get('gpu', 'no GPU')} (compute capability {env.get('capability', '-')}), "
            f"torch {env.get('torch', '-')}", "",
            f"{result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped; "
            f"{result['wall_s']:.0f} s of a {result['total_budget_s']} s budget", "",
            "| step | status | s | budget s | figures / reason |", "|---|---|---|---|---|"]
    rows = []
    for s in result["steps"]:
        figures = s.get("reason", "") if s["status"] != "pass" else ""
        figures = (figures + " " + _short(s.get("figures") or {})).strip()
        rows.append(f"| {s['name']} | {s['status']} | {s.get('seconds', '-')} | {s['budget_s']} | "
                    f"{figures.replace('|', '/')} |")
    return "\n".join(head + rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the steps and budgets as one JSON object")
    p.add_argument("--out", default="gpu-check", help="folder for check.json, check.md, logs/ and the runs")
    p.add_argument("--part", choices=("1", "2", "all"), default="all",
                   help="1: one-process compute, FP8, allocator, export, inference and serving; 2: torchrun DDP/FSDP2 "
                        "and compile gains. On a 15-minute lease run --part 1, then --part 2")
    p.add_argument("--only", help="comma-separated step names to run (the others are recorded as skipped)")
    p.add_argument("--budget", type=float, help="seconds for the whole call (default: the selected steps' budgets)")
    args = p.parse_args()
    if args.dry_run:
        print(json.dumps(plan()))
        return 0
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out, sys.executable)
    chosen = selected(args.part, args.only)
    budget = args.budget or sum(s.budget_s for s in STEPS if s.name in chosen)
    start = time.perf_counter()
    steps = []
    for step in STEPS:
        left = budget - (time.perf_counter() - start)
        if step.name not in chosen:
            entry = {"name": step.name, "what": step.what, "budget_s": step.budget_s, "status": "skipped",
                     "reason": "not in --only" if args.only else f"not in --part {args.part}"}
        elif steps and steps[0]["status"] != "pass":
            entry = {"name": step.name, "what": step.what, "budget_s": step.budget_s, "status": "skipped",
                     "reason": "no usable CUDA GPU (step env failed)"}
        else:
            print(f"[{time.perf_counter() - start:5.0f} s] {step.name}: {step.what}", file=sys.stderr, flush=True)
            entry = run_step(step, ctx, left)
        ctx.results[step.name] = entry
        steps.append(entry)
        if entry["status"] != "skipped":
            print(f"        {entry['status']} in {entry.get('seconds', 0)} s {entry.get('reason', '')}",
                  file=sys.stderr, flush=True)
    counts = {key: sum(s["status"] == status for s in steps)
              for key, status in (("passed", "pass"), ("failed", "fail"), ("skipped", "skipped"))}
    result = {"benchmark": "gpu-check", "part": "only" if args.only else args.part, "total_budget_s": budget,
              "wall_s": time.perf_counter() - start, **counts, "steps": steps}
    (out / "check.json").write_text(json.dumps(result, indent=2))
    (out / "check.md").write_text(markdown(result))
    print(markdown(result))
    if steps[0]["status"] != "pass":
        print(f"check.py: needs a CUDA GPU: {steps[0].get('reason', '')}; see {out / 'logs' / 'env.log'}",
              file=sys.stderr)
    return 0 if counts["failed"] == 0 and steps[0]["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

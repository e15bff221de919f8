"""The one device check: every CUDA path of torchcls on one GPU, one JSON and one Markdown table with
pass/fail and figures. Run through check.sh (which picks the project's .venv).

    bash benchmarks/gpu/check.sh --dry-run                 # the steps, parts and budgets as one JSON object
    bash benchmarks/gpu/check.sh --part 1 --out gpu-check  # on a GPU machine: gpu-check/check.json, check.md
    bash benchmarks/gpu/check.sh --part 1 --out gpu-check --collect "$OUT"   # and the results in <= 8 files
    PY=/path/to/torch-2.11/python bash benchmarks/gpu/check.sh --part 1 --rehearse --out r   # CPU stand-ins

The steps, their parts and budgets are in check_steps.py: part 1 fits one call of 8 minutes and holds what
matters most (FP8 where it can pay, the CUDA export taken apart, the data path), parts 2 and 3 the rest.
Each step is a subprocess with its own timeout (its budget, or what is left of the call's if less); a
step that overruns is killed (its whole process group) and recorded as failed, and once the call's budget
is spent the remaining steps are recorded as skipped. Steps that need an earlier step's output are skipped,
with the reason, when that step failed; a diagnosis step runs only when the step it diagnoses failed.
Every step runs with PYTHONFAULTHANDLER=1, the checkout's src/ first on PYTHONPATH, one Inductor cache for
the call (later compiles of the same graphs hit it) and an export record of its own (so the packages it
builds load without --trust-artifact, and nothing is added to the user's record).

`--rehearse` runs each step's CPU stand-in instead (check_steps.py: the same scripts at tiny sizes with
--device cpu): run it under the torch the device has (2.11) before a GPU is spent on the real thing.

This module imports nothing beyond the standard library, so --dry-run needs no torch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_steps import PART_BUDGET_S, REPO, STEPS, Ctx, Step  # noqa: E402

MIN_STEP_S = 10  # a step is not started with less time left than this
COLLECT_MAX_BYTES = 15 * 2**20  # per file brought back from the device machine (its limit: 16 MiB, 8 files)


def plan() -> dict[str, Any]:
    """The steps as --dry-run prints them: budget, parts, whether a CPU stand-in exists, what each needs."""
    steps = [{"name": s.name, "budget_s": s.budget_s, "parts": list(s.parts), "needs": list(s.needs),
              "rehearsal": s.rehearsal is not None, "only_if_failed": s.only_if_failed or None, "what": s.what}
             for s in STEPS]
    parts = {str(p): sum(s.budget_s for s in STEPS if p in s.parts and not s.only_if_failed) for p in PART_BUDGET_S}
    return {"steps": steps, "parts": parts, "part_budget_s": {str(k): v for k, v in PART_BUDGET_S.items()},
            "conditional_s": {s.name: s.budget_s for s in STEPS if s.only_if_failed},
            "total_budget_s": sum(s.budget_s for s in STEPS if not s.only_if_failed)}


def selected(part: str, only: str | None) -> set[str]:
    """The steps one call runs: --only's (and what they need), else a part's or all; env always."""
    if only:
        return with_needs(set(only.split(","))) | {"env"}
    return {s.name for s in STEPS if part == "all" or int(part) in s.parts}


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


def step_env(out: Path) -> dict[str, str]:
    """What every step runs with: this checkout's src/ first, then the caller's PYTHONPATH (e.g. wheels installed
    with --target on a machine whose Python is not the project's); faulthandler on; one Inductor cache for the
    call; an export record of the call's own."""
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1",
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(out / "inductor-cache")),
            "TORCHCLS_EXPORT_RECORD": str(out / "exports.jsonl")}


def run_command(cmd: list[str], timeout: float, log: Path, env: dict[str, str]) -> tuple[int | None, float]:
    """(exit code or None on timeout, seconds). The command gets its own process group: on timeout the
    whole group (torchrun's workers, DataLoader workers, compile workers) is killed."""
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env=os.environ | env)
        try:
            code: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.perf_counter() - start


def _why(code: int | None) -> str:
    if code is None:
        return "timed out"
    if code < 0:  # killed by a signal: name it (SIGSEGV was the CUDA export's first failure)
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_step(step: Step, ctx: Ctx, left_s: float, rehearse: bool = False) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": step.name, "what": step.what, "budget_s": step.budget_s}
    failed = [n for n in step.needs if ctx.results.get(n, {}).get("status") != "pass"]
    if failed:
        return entry | {"status": "skipped", "reason": f"needs {', '.join(failed)}, which did not pass"}
    if step.only_if_failed and ctx.results.get(step.only_if_failed, {}).get("status") != "fail":
        return entry | {"status": "skipped", "reason": f"runs only when {step.only_if_failed} failed"}
    commands = step.rehearsal if rehearse else step.commands
    if commands is None:
        return entry | {"status": "skipped", "reason": "no CPU stand-in (CUDA only)"}
    if left_s < MIN_STEP_S:
        return entry | {"status": "skipped", "reason": f"total budget spent ({left_s:.0f} s left)"}
    deadline = time.perf_counter() + min(step.budget_s if not rehearse else 600, left_s)
    log = ctx.out / "logs" / f"{step.name}.log"
    elapsed = 0.0
    for cmd in commands(ctx):
        code, secs = run_command(cmd, deadline - time.perf_counter(), log, step_env(ctx.out))
        elapsed += secs
        if code != 0:
            return entry | {"status": "fail", "seconds": round(elapsed, 1), "reason": f"{_why(code)}: "
                            f"{' '.join(cmd[:6])} ... (log: {log.relative_to(ctx.out)})", "figures": _safe(step.figures, ctx)}
    return entry | {"status": "pass", "seconds": round(elapsed, 1), "figures": _safe(step.figures, ctx)}


def _safe(fn: Callable[[Ctx], dict[str, Any]], ctx: Ctx) -> dict[str, Any]:
    try:
        return fn(ctx)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {"figures_error": repr(e)}


def _short(figures: dict[str, Any]) -> str:
    """One table cell: the compile rows as 'model bN: gain (timm's)', other figures as compact JSON."""
    if figures.get("rows") and {"model", "speedup"} <= set(figures["rows"][0]):  # bench compile's rows
        return "; ".join(f"{r['model']} b{r['batch']}: " + (f"{r['speedup']}x (timm {r['timm_published']})"
                                                          if r.get("speedup") else str(r.get("error"))[:80])
                         for r in figures["rows"])
    shown = _without(figures, ("advice", "levels", "losses", "fp8_layers", "package_files", "output_tail",
                               "child_tail", "headers", "libcuda"))
    return json.dumps(shown, separators=(",", ":"))[:600] if shown else ""


def _without(value: Any, keys: tuple[str, ...]) -> Any:
    """`value` with `keys` left out at every depth (per-step losses, advice text: in check.json only)."""
    if isinstance(value, dict):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    return value


def markdown(result: dict[str, Any]) -> str:
    env = result["steps"][0].get("figures") or {}
    kind = "CPU rehearsal (figures meaningless)" if result.get("rehearsal") else \
        f"{env.get('gpu', 'no GPU')} (compute capability {env.get('capability', '-')})"
    head = [f"# torchcls device check: {kind}, torch {env.get('torch', '-')}", "",
            f"part {result['part']}: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped; "
            f"{result['wall_s']:.0f} s of a {result['total_budget_s']:.0f} s budget", "",
            "| step | status | s | budget s | figures / reason |", "|---|---|---|---|---|"]
    rows = []
    for s in result["steps"]:
        figures = s.get("reason", "") if s["status"] != "pass" else ""
        try:
            figures = (figures + " " + _short(s.get("figures") or {})).strip()
        except (KeyError, TypeError, ValueError) as e:  # a figure of an unexpected shape: check.json has it whole
            figures = f"{figures} (figures in check.json; not shown here: {e!r})".strip()
        rows.append(f"| {s['name']} | {s['status']} | {s.get('seconds', '-')} | {s['budget_s']} | "
                    f"{figures.replace('|', '/')} |")
    return "\n".join(head + rows) + "\n"


def collect(out: Path, dest: Path) -> list[str]:
    """What comes back from the device machine (at most 8 files of at most 16 MiB, 2 folders deep): check.json,
    check.md, every step's JSON and log in results.tar.gz (logs cut to their last MiB), the AOTInductor sources
    and the parity report."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "check.json", dest / "check.json")
    shutil.copy(out / "check.md", dest / "check.md")
    with tarfile.open(dest / "results.tar.gz", "w:gz") as tar:
        for path in sorted([*out.glob("*.json"), *out.glob("logs/*.log"), *out.glob("export*/parity.json"),
                            *out.glob("runs/*/*.json"), *out.glob("runs/*/metrics.jsonl")]):
            data = path.read_bytes()[-2**20:]  # a log's last MiB: where it ended
            info = tarfile.TarInfo(str(path.relative_to(out)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sources = out / "aoti" / "aoti_sources.tar.gz"
    if sources.exists() and sources.stat().st_size <= COLLECT_MAX_BYTES:
        shutil.copy(sources, dest / "aoti_sources.tar.gz")
    return sorted(p.name for p in dest.iterdir())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the steps and budgets as one JSON object")
    p.add_argument("--out", default="gpu-check", help="folder for check.json, check.md, logs/ and the runs")
    p.add_argument("--part", choices=("1", "2", "3", "all"), default="all",
                   help="1: FP8 table and step, the CUDA export taken apart, the data path (8 minutes); 2: export, "
                        "serve and train end to end, FP8 rowwise and FSDP2 all-gather; 3: DDP/FSDP2 over NCCL, "
                        "compile gains, bf16 steps. On a 15-minute lease: --part 1")
    p.add_argument("--only", help="comma-separated step names to run (the others are recorded as skipped)")
    p.add_argument("--budget", type=float, help="seconds for the whole call (default: the selected steps' budgets)")
    p.add_argument("--rehearse", action="store_true", help="run each step's CPU stand-in (tiny sizes, --device cpu)")
    p.add_argument("--collect", help="also copy the results into this folder as at most 8 files (the device's $OUT)")
    args = p.parse_args()
    if args.dry_run:
        print(json.dumps(plan()))
        return 0
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out, sys.executable)
    chosen = selected(args.part, args.only)
    budget = args.budget or (1e9 if args.rehearse else
                             sum(s.budget_s for s in STEPS if s.name in chosen and not s.only_if_failed))
    result = run_steps(ctx, chosen, budget, args)
    (out / "check.json").write_text(json.dumps(result, indent=2))
    (out / "check.md").write_text(markdown(result))
    print(markdown(result))
    if args.collect:
        print(f"collected into {args.collect}: {', '.join(collect(out, Path(args.collect)))}", file=sys.stderr)
    env_ok = result["steps"][0]["status"] == "pass"
    if not env_ok:
        print(f"check.py: needs a CUDA GPU: {result['steps'][0].get('reason', '')}; see {out / 'logs' / 'env.log'}",
              file=sys.stderr)
    return 0 if result["failed"] == 0 and env_ok else 1


def run_steps(ctx: Ctx, chosen: set[str], budget: float, args) -> dict[str, Any]:
    start = time.perf_counter()
    steps = []
    for step in STEPS:
        left = budget - (time.perf_counter() - start)
        skipped = {"name": step.name, "what": step.what, "budget_s": step.budget_s, "status": "skipped"}
        if step.name not in chosen:
            entry = skipped | {"reason": "not in --only" if args.only else f"not in --part {args.part}"}
        elif steps and steps[0]["status"] != "pass":
            entry = skipped | {"reason": "no usable CUDA GPU (step env failed)"}
        else:
            print(f"[{time.perf_counter() - start:5.0f} s] {step.name}: {step.what}", file=sys.stderr, flush=True)
            entry = run_step(step, ctx, left, args.rehearse)
        ctx.results[step.name] = entry
        steps.append(entry)
        if entry["status"] != "skipped":
            print(f"        {entry['status']} in {entry.get('seconds', 0)} s {entry.get('reason', '')}",
                  file=sys.stderr, flush=True)
    counts = {key: sum(s["status"] == status for s in steps)
              for key, status in (("passed", "pass"), ("failed", "fail"), ("skipped", "skipped"))}
    return {"benchmark": "gpu-check", "part": "only" if args.only else args.part, "rehearsal": args.rehearse,
            "total_budget_s": budget, "wall_s": time.perf_counter() - start, **counts, "steps": steps}


if __name__ == "__main__":
    sys.exit(main())

"""`torchcls bench memory`: per-rank memory of DDP and FSDP2 training as the world grows, measured
in real torchrun jobs, next to the analytic model, and what fits on a heterogeneous cluster.

Each (parallel, world size) configuration is its own torchrun job (suite/memory_scaling_worker.py); one
that fails or cannot start is recorded and the rest go on. The fit advice uses the analytic
model of suite/memory_fit.py, fed with what the jobs measured (state bytes per rank, activation
bytes per sample, the largest FSDP unit).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.console import console
from torchcls.errors import UserError
from torchcls.options import BenchMemoryOptions, split_ints, split_list
from torchcls.run_files import write_text_atomic
from torchcls.suite import memory_fit as mf

PARALLEL = ("ddp", "fsdp2")


@dataclass
class BenchMemoryConfig:
    model: str
    parallel: list[str]
    world_sizes: list[int]
    device_memory: list[int] | None = None  # bytes per rank (rank order, repeated); None: this machine's
    batch: int = 2  # images per rank in the measured steps
    img_size: int | None = None  # default: 224 (28 for smallnet)
    steps: int = 2
    overhead: int = 2**30
    timeout_s: int = 1800

    @property
    def size(self) -> int:
        return self.img_size or (28 if self.model == "smallnet" else 224)

    @property
    def classes(self) -> int:
        return 10 if self.model == "smallnet" else 1000


def config_from(opts: BenchMemoryOptions) -> BenchMemoryConfig:
    """`torchcls bench memory`'s options (declared in options.py), sizes parsed to bytes."""
    memory = [mf.parse_size(v, "--device-memory") for v in split_list(opts.device_memory or "")] or None
    return BenchMemoryConfig(opts.model, split_list(opts.parallel), split_ints(opts.world_sizes, "--world-sizes"),
                             memory, opts.batch, opts.img_size, opts.steps, mf.parse_size(opts.overhead, "--overhead"),
                             opts.timeout)


def full_state_bytes(cfg: BenchMemoryConfig) -> int:
    """Parameters + gradients + AdamW's two moments (fp32), from the model built on the meta device:
    nothing is allocated, and an unknown model name fails here, before any job starts."""
    import torch

    from torchcls.models import ModelSpec, create_model

    with torch.device("meta"):
        model = create_model(ModelSpec(cfg.model, cfg.classes, 3, cfg.size))
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def check_config(cfg: BenchMemoryConfig) -> None:
    bad = [p for p in cfg.parallel if p not in PARALLEL]
    if bad or not cfg.parallel:
        raise UserError(f"--parallel: unknown {', '.join(bad) or '(empty)'}; choose from ddp, fsdp2 (comma-separated)")
    if not cfg.world_sizes or any(w < 1 for w in cfg.world_sizes):
        raise UserError(f"--world-sizes must be positive integers, got {cfg.world_sizes}")
    if cfg.batch < 1 or cfg.steps < 1:
        raise UserError("--batch and --steps must be at least 1")


def _device() -> tuple[str, int]:
    import torch

    return ("cuda", torch.cuda.device_count()) if torch.cuda.is_available() else ("cpu", 0)


def cannot_start(cfg: BenchMemoryConfig, parallel: str, world: int, state_bytes: int) -> str | None:
    """Why this configuration would not start here (recorded as skipped), or None."""
    device, gpus = _device()
    if device == "cuda":
        return f"needs {world} GPUs, this machine has {gpus}" if world > gpus else None
    import psutil

    # All ranks share this host's RAM. Per rank: DDP holds the whole state plus its gradient buckets;
    # FSDP2 first builds the full parameters (a quarter of the state), then keeps its shard. Plus
    # ~0.6 GB of runtime per process.
    per_rank = 1.25 * state_bytes if parallel == "ddp" else state_bytes / 4 + state_bytes / world
    need = world * (per_rank + 0.6e9)
    free = psutil.virtual_memory().available
    return f"needs about {mf.gib(need)} of host RAM, {mf.gib(free)} free" if need > 0.8 * free else None


USER_ERROR = ": error: "  # in "torchrun exited N: error: ...": the worker refused the configuration


def launch(cfg: BenchMemoryConfig, parallel: str, world: int, tmp: Path) -> dict[str, Any]:
    """One configuration's torchrun job. A job that fails is started once more, unless it timed out or
    the worker itself refused the configuration (`error: ...`, which would only repeat): a rendezvous or
    gloo connection that breaks while ranks start is the host's hiccup, not a figure of this benchmark.
    The first attempt's error stays in the result, beside the second's outcome."""
    first = _launch_once(cfg, parallel, world, tmp)
    if first["status"] == "ok" or first["error"].startswith("timed out") or USER_ERROR in first["error"]:
        return first
    return _launch_once(cfg, parallel, world, tmp) | {"first_attempt_error": first["error"]}


def _launch_once(cfg: BenchMemoryConfig, parallel: str, world: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{parallel}-{world}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "torchcls.suite.memory_scaling_worker", "--model", cfg.model, "--parallel", parallel,
           "--batch", str(cfg.batch), "--img-size", str(cfg.size), "--classes", str(cfg.classes),
           "--steps", str(cfg.steps), "--out", str(out)]
    # One thread per rank: the ranks share the host's cores (and each rank's state is the subject).
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {cfg.timeout_s} s"}
    if proc.returncode != 0 or not out.is_file():
        return {"status": "failed", "error": f"torchrun exited {proc.returncode}: {worker_error(proc.stderr)[:500]}"}
    return {"status": "ok", "ranks": json.loads(out.read_text())}


def worker_error(stderr: str) -> str:
    """The line of torchrun's stderr that says why a rank failed: the worker's own `error: ...` (a user
    error), else the last exception a rank raised; not torchrun's ChildFailedError summary after it.
    torchrun prefixes a rank's traceback lines with `[rankN]:`; the prefix is dropped."""
    lines = [t for x in stderr.splitlines() if (t := re.sub(r"^\[rank\d+\]:", "", x).strip())]
    mine = [x for x in lines if x.startswith("error: ")]
    raised = [x for x in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", x) and "ChildFailedError" not in x]
    return (mine or raised or lines or ["no output"])[0 if mine else -1]


def _annotate(cfg: BenchMemoryConfig, r: dict[str, Any]) -> None:
    """Add the analytic model's figures next to each rank's measurement."""
    for rank in r["ranks"]:
        full = rank.pop("full")
        rank |= {"full_state_bytes": sum(full.values()), "full_grad_bytes": full["grad_bytes"]}
        m = mf.rank_model(r["parallel"], r["world"], rank)
        rank |= {"expected_state_bytes": m.state_bytes, "transient_bytes": m.transient_bytes,
                 "activation_bytes": m.activation_bytes_per_sample * cfg.batch,
                 "expected_peak_bytes": m.peak(cfg.batch, 0),  # without the overhead allowance
                 # CUDA: allocated by tensors; CPU: the process's RSS (runtime included), both since the steps began
                 "memory_before_steps_bytes": rank.get("cuda_allocated_before_steps_bytes", rank["rss_before_steps_bytes"]),
                 "measured_peak_bytes": rank.get("cuda_peak_allocated_bytes", rank["peak_rss_bytes"])}


def cluster(cfg: BenchMemoryConfig, world: int) -> tuple[list[int], str]:
    if cfg.device_memory:
        return mf.capacities(cfg.device_memory, world), "--device-memory"
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_properties(0).total_memory] * world, torch.cuda.get_device_name(0)
    import psutil

    return [psutil.virtual_memory().total // world] * world, "this host's RAM shared by the ranks"


def fits(cfg: BenchMemoryConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == "ok"]
    out = [mf.fit(r["parallel"], r["world"], [mf.rank_model(r["parallel"], r["world"], k) for k in r["ranks"]],
                  cluster(cfg, r["world"])[0], cfg.overhead, projected=False) for r in ok]
    # The whole cluster the user described, when no measured job had that many ranks.
    target = len(cfg.device_memory or [])
    for parallel in cfg.parallel:
        measured = [r for r in ok if r["parallel"] == parallel]
        if measured and target > max(r["world"] for r in measured):
            rank = max(measured, key=lambda r: r["world"])["ranks"][0]
            out.append(mf.fit(parallel, target, [mf.rank_model(parallel, target, rank)] * target,
                              mf.capacities(cfg.device_memory, target), cfg.overhead, projected=True))
    return {"source": cluster(cfg, 1)[1], "overhead_bytes": cfg.overhead, "headroom": mf.HEADROOM,
            "configs": out, "recommendation": mf.recommend(out)}


def bench_memory(cfg: BenchMemoryConfig, out_dir: str | Path) -> dict[str, Any]:
    """Run every configuration, write bench_memory.json/.md/.png into out_dir, return the result."""
    check_config(cfg)
    state = full_state_bytes(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="torchcls-bench-memory-") as tmp:
        for world in cfg.world_sizes:
            for parallel in cfg.parallel:
                head = {"parallel": parallel, "world": world}
                console.print(f"bench memory: {cfg.model} {parallel} × {world} ...")
                reason = cannot_start(cfg, parallel, world, state)
                r = head | ({"status": "skipped", "error": reason} if reason else launch(cfg, parallel, world, Path(tmp)))
                if r["status"] == "ok":
                    _annotate(cfg, r)
                    r0 = r["ranks"][0]
                    console.print(f"  state {r0['total_bytes'] / 2**20:.1f} MiB per rank (analytic "
                                  f"{r0['expected_state_bytes'] / 2**20:.1f}), peak "
                                  f"{r0['measured_peak_bytes'] / 2**20:.0f} MiB")
                else:
                    console.print(f"  {r['status']}: {r['error']}")
                results.append(r)
    data = {"model": cfg.model, "img_size": cfg.size, "batch_per_rank": cfg.batch, "steps": cfg.steps,
            "machine": _machine(), "results": _with_ratios(results)}
    data["fit"] = fits(cfg, results)
    write_text_atomic(out / "bench_memory.json", json.dumps(data, indent=2))
    write_text_atomic(out / "bench_memory.md", to_markdown(data))
    from torchcls.report.plots import rank_memory_bars

    rank_memory_bars(data["results"], out / "bench_memory.png")
    return data


def _machine() -> dict[str, Any]:
    import torch

    device, gpus = _device()
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "device": device, "gpus": gpus, "backend": "nccl" if device == "cuda" else "gloo"}


def _with_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's state relative to the same mode's world-size-1 state (1/world expected for FSDP2)."""
    base = {r["parallel"]: r["ranks"][0]["total_bytes"] for r in results if r["status"] == "ok" and r["world"] == 1}
    for r in results:
        for rank in r.get("ranks", []):
            rank["state_vs_world1"] = rank["total_bytes"] / base[r["parallel"]] if r["parallel"] in base else None
    return results


def to_markdown(data: dict[str, Any]) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = [f"`{data['model']}`, {data['img_size']} px, {data['batch_per_rank']} images per rank, "
             f"{data['machine']['device']} ({data['machine']['backend']})", "",
             "| parallel | world | rank | params MiB | grads MiB | optimizer MiB | state MiB | analytic state MiB | "
             "state / world-1 | activations MiB | transient MiB | analytic peak MiB | memory before steps MiB | "
             "measured peak in steps MiB |", "|---" * 14 + "|"]
    for r in data["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['parallel']} | {r['world']} | - | {r['status']}: {r['error'][:90]} |" + " |" * 10)
            continue
        for k in r["ranks"]:
            ratio = "-" if k["state_vs_world1"] is None else f"{k['state_vs_world1']:.3f}"
            lines.append(f"| {r['parallel']} | {r['world']} | {k['rank']} | {mib(k['param_bytes'])} | "
                         f"{mib(k['grad_bytes'])} | {mib(k['optimizer_bytes'])} | {mib(k['total_bytes'])} | "
                         f"{mib(k['expected_state_bytes'])} | {ratio} | {mib(k['activation_bytes'])} | "
                         f"{mib(k['transient_bytes'])} | {mib(k['expected_peak_bytes'])} | "
                         f"{mib(k['memory_before_steps_bytes'])} | {mib(k['measured_peak_bytes'])} |")
    f = data["fit"]
    lines += ["", f"Fit on {f['source']} (allowance {mf.gib(f['overhead_bytes'])} per rank for the runtime, "
              f"{f['headroom']:.0%} kept free for fragmentation):", ""]
    lines += [f"- {c['verdict']}" for c in f["configs"]] + [f"- **{f['recommendation']}**"]
    return "\n".join(lines) + "\n"

"""`torchcls bench compile`: eager vs torch.compile per backbone, batch, precision and mode.

Each configuration runs in its own subprocess with a fresh Inductor cache (so the cold
compile time is honest and compiled variants do not interfere); inside it, eager and
compiled calls are interleaved. A configuration that fails is recorded and the rest go on.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.console import console
from torchcls.errors import UserError
from torchcls.options import BenchCompileOptions, split_ints, split_list
from torchcls.run_files import write_text_atomic

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class BenchCompileConfig:
    models: list[str]
    batches: list[int]
    precisions: list[str]
    modes: list[str]
    device: str = "cpu"
    img_size: int | None = None
    repeats: int = 10
    timeout_s: int = 1800


def config_from(opts: BenchCompileOptions) -> BenchCompileConfig:
    """`torchcls bench compile`'s options (declared in options.py) as the lists this benchmark runs over."""
    return BenchCompileConfig(split_list(opts.models), split_ints(opts.batch, "--batch"), split_list(opts.precision),
                              split_list(opts.modes), opts.device, opts.img_size, opts.repeats, opts.timeout)


def check_config(cfg: BenchCompileConfig) -> None:
    from torchcls.models.registry import create_model  # noqa: F401  (fail fast on a broken install)

    bad = [p for p in cfg.precisions if p not in ("fp32", "bf16")] + [m for m in cfg.modes if m not in MODES]
    if bad:
        raise UserError(f"unknown --precision/--modes value(s): {', '.join(bad)}; precisions: fp32, bf16; "
                        f"modes: {', '.join(MODES)}")
    if not cfg.batches or any(b < 1 for b in cfg.batches):
        raise UserError(f"--batch must be positive integers, got {cfg.batches}")
    for name in cfg.models:
        if ":" in name or name == "smallnet" or Path(name).exists():
            continue
        import timm

        from torchcls.models.registry import _unknown

        if not name.startswith("tv/") and not timm.is_model(name):
            raise UserError("--models: " + _unknown(name, timm.list_models()))


def run_config(model: str, batch: int, precision: str, mode: str, cfg: BenchCompileConfig) -> dict[str, Any]:
    cache = Path(tempfile.mkdtemp(prefix="torchcls-bench-inductor-"))
    cmd = [sys.executable, "-m", "torchcls.suite.compile_gains_worker", "--model", model, "--batch", str(batch),
           "--precision", precision, "--mode", mode, "--device", cfg.device, "--repeats", str(cfg.repeats)]
    if cfg.img_size:
        cmd += ["--img-size", str(cfg.img_size)]
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TMPDIR": str(cache)}
    head = {"model": model, "batch": batch, "precision": precision, "mode": mode}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cfg.timeout_s)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return head | {"status": "failed", "error": f"worker exited {proc.returncode}: {err[:500]}"}
        return head | json.loads(lines[-1])
    except subprocess.TimeoutExpired:
        return head | {"status": "failed", "error": f"timed out after {cfg.timeout_s} s"}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def verdict(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    failed = len(rows) - len(ok)
    tail = f"; {failed} configuration(s) failed" if failed else ""
    if not ok:
        return f"no result: {rows[0].get('error', 'failed')}"
    best = max(ok, key=lambda r: r["speedup"])
    breaks = max(r["graph_breaks"] for r in ok)
    reasons = sorted({x for r in ok for x in r["break_reasons"]})
    brk = "none" if not breaks else f"{breaks} ({'; '.join(reasons)[:120]})"
    setting = f"b{best['batch']} {best['precision']}" + ("" if best["mode"] == "default" else f" {best['mode']}")
    pays = "pays" if best["speedup"] >= 1.05 else "does not pay"
    return (f"compile {pays} {best['speedup']:.2f}× at {setting} (cold compile {best['compile_s']:.0f} s); "
            f"breaks: {brk}; recompiles over batch sizes: {max(r['recompiles'] for r in ok)}{tail}")


def bench_compile(cfg: BenchCompileConfig, out_dir: str | Path) -> dict[str, Any]:
    """Run every configuration, write bench_compile.json/.md/.png into out_dir, return the result."""
    check_config(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    if note := emulated_bf16_note(cfg):
        console.print(f"[yellow]{note}[/]", highlight=False)
    for model, batch, precision, mode in itertools.product(cfg.models, cfg.batches, cfg.precisions, cfg.modes):
        console.print(f"bench compile: {model} b{batch} {precision} {mode} ...")
        r = run_config(model, batch, precision, mode, cfg)
        results.append(r)
        console.print(f"  {r['status']}" + (f": eager {r['eager_ms']['median']:.2f} ms, compiled "
                                           f"{r['compiled_ms']['median']:.2f} ms, {r['speedup']:.2f}×, cold compile "
                                           f"{r['compile_s']:.0f} s, {r['graph_breaks']} break(s)"
                                           if r["status"] == "ok" else f": {r['error']}"))
        data = _write(out, cfg, results)  # after every configuration: a long run keeps what it measured
    return data


def emulated_bf16_note(cfg: BenchCompileConfig) -> str:
    """Said (console, JSON, Markdown) when bf16 is measured on a CPU that emulates it: its figures are then
    the emulation's, many times slower than fp32, not what bf16 gives where it is native."""
    if "bf16" not in cfg.precisions or cfg.device != "cpu":
        return ""
    from torchcls.precision.hardware import cpu_bf16_here

    native, why = cpu_bf16_here()
    return "" if native else f"bf16 is emulated on this machine ({why}): its figures are not bf16's on native hardware"


def _write(out: Path, cfg: BenchCompileConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    from torchcls.machine import describe_machine

    done = {r["model"] for r in results}
    data = {"machine": describe_machine(",".join(cfg.precisions)) | {
                "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                "device": cfg.device, "cuda": torch.cuda.get_device_name() if cfg.device.startswith("cuda")
                and torch.cuda.is_available() else None, "threads": torch.get_num_threads(),
                "bf16_note": emulated_bf16_note(cfg),
                "note": f"{cfg.repeats} interleaved repeats per configuration, medians (min–max)"},
            "results": results,
            "verdicts": {m: verdict([r for r in results if r["model"] == m]) for m in cfg.models if m in done}}
    write_text_atomic(out / "bench_compile.json", json.dumps(data, indent=2))
    write_text_atomic(out / "bench_compile.md", to_markdown(data))
    from torchcls.report.plots import compile_speedups

    compile_speedups(results, out / "bench_compile.png")
    return data


def to_markdown(data: dict[str, Any]) -> str:
    from torchcls.machine import machine_line

    m = data["machine"]  # results written before the machine record have no "cores"
    head = ([f"Machine: {machine_line(m)}"] if "cores" in m else []) + \
        ([f"**{m['bf16_note']}**"] if m.get("bf16_note") else [])
    lines = [*head, *([""] if head else []),
             "| model | batch | precision | mode | eager ms | compiled ms | speedup | cold compile s | graphs | "
             "breaks | recompiles | max abs diff | top-1 agree | peak RSS MiB |", "|---" * 14 + "|"]
    for r in data["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['batch']} | {r['precision']} | {r['mode']} | failed: "
                         f"{r['error'][:80]} |" + " |" * 9)
            continue
        e, c = r["eager_ms"], r["compiled_ms"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['precision']} | {r['mode']} | {e['median']:.2f} "
                     f"({e['min']:.2f}–{e['max']:.2f}) | {c['median']:.2f} ({c['min']:.2f}–{c['max']:.2f}) | "
                     f"{r['speedup']:.2f}× | {r['compile_s']:.1f} | {r['graphs']} | {r['graph_breaks']} | "
                     f"{r['recompiles']} | {r['max_abs_diff']:.2e} | {r['top1_agree']:.2f} | "
                     f"{r['peak_rss_bytes'] / 2**20:.0f} |")
    lines += [""] + [f"- **{m}**: {v}" for m, v in data["verdicts"].items()]
    return "\n".join(lines) + "\n"

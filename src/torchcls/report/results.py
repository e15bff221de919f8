"""Report sections for the evaluation commands: exports/parity, compile gains, memory, kernel audit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.report import plots
from torchcls.report.htmlkit import esc, fmt, img, kpis, mib, status, table
from torchcls.report.sections import read_json, section


@section("exports", "Exports and parity", "torchcls export (writes parity.json next to each artifact)", 30)
def exports(run_dir: Path) -> str | None:
    files = sorted(run_dir.rglob("parity.json")) + sorted(run_dir.rglob("*.parity.json"))
    if not files:
        return None
    parts = []
    for f in files:
        data = read_json(f)
        if not isinstance(data, dict):
            parts.append(f"<p>{esc(f.relative_to(run_dir))}: unreadable</p>")
            continue
        rows = [[k, fmt(v)] for k, v in _flatten(data).items()]
        artifacts = sorted(p.name for p in f.parent.iterdir() if p.is_file() and not p.name.endswith(".json"))
        parts.append(f"<h3>{esc(f.parent.relative_to(run_dir) or '.')}</h3><p>artifacts: "
                     f"{esc(', '.join(artifacts) or 'none next to it')}</p>" + table(["parity", "value"], rows))
    return "".join(parts)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        elif not isinstance(v, list):
            out[prefix + k] = v
    return out


@section("compile", "Compile gains", "torchcls bench compile --models ... --out RUN_DIR", 40)
def compile_gains(run_dir: Path) -> str | None:
    path = next(iter(sorted(run_dir.rglob("bench_compile.json"))), None)
    data = read_json(path) if path else None
    if not data:
        return None
    parts = ["<ul>" + "".join(f"<li><b>{esc(m)}</b>: {esc(v)}</li>" for m, v in data["verdicts"].items()) + "</ul>"]
    rows = [[r["model"], r["batch"], r["precision"], r["mode"], r["status"],
             _ms(r.get("eager_ms")), _ms(r.get("compiled_ms")), _x(r.get("speedup")), fmt(r.get("compile_s", "-")),
             r.get("graphs", "-"), r.get("graph_breaks", "-"), r.get("recompiles", "-"),
             fmt(r.get("max_abs_diff", "-"))] for r in data["results"]]
    parts.append(table(["model", "batch", "precision", "mode", "status", "eager ms", "compiled ms", "speedup",
                        "cold compile s", "graphs", "breaks", "recompiles", "max |Δ|"], rows))
    if plots.compile_speedups(data["results"], run_dir / "bench_compile.png"):
        parts.append(img(run_dir / "bench_compile.png"))
    return f"<p>{esc(data.get('machine', {}).get('note', ''))}</p>" + "".join(parts)


def _ms(stat: dict[str, float] | None) -> str:
    return "-" if not stat else f"{stat['median']:.2f} ({stat['min']:.2f}–{stat['max']:.2f})"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}×"


@section("memory", "Memory", "torchcls train --memory-report (or --memory-snapshot on CUDA)", 50)
def memory(run_dir: Path) -> str | None:
    m = read_json(run_dir / "allocator.json")
    if not m:
        return None
    a = m["allocator"]
    if a["available"]:
        parts = [kpis([("peak allocated", mib(a["allocated_peak_bytes"])), ("peak reserved", mib(a["reserved_peak_bytes"])),
                       ("fragmentation max", f"{a['fragmentation_pct_max']:.1f}%"),
                       ("alloc retries", a["num_alloc_retries"]), ("OOMs", a["num_ooms"])])]
        parts += [f"<p class='st-warn'>advice: {esc(t)}</p>" for t in a["advice"]] or ["<p>no allocator advice</p>"]
        if m.get("snapshot", {}).get("file"):
            parts.append(f"<p>snapshot: <code>{esc(m['snapshot']['file'])}</code> (open at "
                         f"<a href='https://pytorch.org/memory_viz'>pytorch.org/memory_viz</a>)</p>")
    else:
        p = m.get("profiler", {})
        parts = [f"<p class='notrun'>{esc(a['reason'])}</p>",
                 kpis([("peak RSS", mib(m.get("peak_rss_bytes"))), ("profiled steps", p.get("profiled_steps", 0)),
                       ("timeline peak", mib(p.get("timeline_peak_bytes"))),
                       ("allocated in profiled steps", mib(p.get("allocated_bytes_total")))])]
        if p.get("timeline_at_peak"):
            parts.append("<h3>At the timeline peak, by category</h3>" + table(
                ["category", "bytes"], [[k, mib(v)] for k, v in p["timeline_at_peak"].items()]))
        if p.get("top_ops"):
            parts.append("<h3>Ops allocating the most (profiled steps)</h3>" + table(
                ["op", "allocated", "calls"], [[o["op"], mib(o["allocated_bytes"]), o["calls"]] for o in p["top_ops"]]))
    if plots.memory_curves(m, run_dir, run_dir / "memory.png"):
        parts.append(img(run_dir / "memory.png"))
    return "".join(parts)


@section("audit", "Kernel audit", "torchcls audit kernels --model RUN_DIR [--import PKG]", 60)
def kernel_audit(run_dir: Path) -> str | None:
    d = read_json(run_dir / "kernel_audit.json")
    if not d:
        return None
    parts = [f"<p>verdict: {status('pass' if d['passed'] else 'fail')} — {len(d['ops'])} custom op(s), "
             f"{len(d['binaries'])} GPU binar(ies), {len(d['triton_kernels'])} Triton kernel(s); local GPU: "
             f"{esc(d['device'].get('capability') or 'none')}</p>"]
    if d.get("library_ops"):
        from torchcls.kernel_audit.kernels import library_line

        parts.append(f"<p>{esc(library_line(d['library_ops']))}</p>")
    if d["ops"]:
        names = [c["name"] for c in d["ops"][0]["checks"]]
        rows = [[op["name"], " ".join(op["dispatch_keys"]), "yes" if op["traceable"] else "no",
                 *[c["status"] for c in op["checks"]], op["status"]] for op in d["ops"]]
        parts.append(table(["op", "dispatch keys", "traceable", *names, "status"], rows))
        fixes = [[op["name"], c["name"], c["detail"], c["fix"]] for op in d["ops"] for c in op["checks"]
                 if c["status"] in ("fail", "warn")]
        if fixes:
            parts.append("<h3>What to fix</h3>" + table(["op", "check", "finding", "fix"], fixes))
    if d["binaries"]:
        parts.append("<h3>Compiled GPU code</h3>" + table(["file", "cubin", "PTX", "fit"], [
            [Path(b["path"]).name, " ".join(b["sm"]), " ".join(b["ptx"]), f"{b['check']['status']}: {b['check']['detail']}"]
            for b in d["binaries"]]))
    if d.get("model"):
        mo = d["model"]
        found = ", ".join(f"{k} ×{v}" for k, v in mo["custom_ops"].items()) or "none"
        library = ", ".join(f"{k} ×{v}" for k, v in mo.get("library_ops", {}).items())
        parts.append(f"<p>model {esc(mo['target'])}: " + (f"custom ops in the exported graph: {esc(found)}"
                     + (f"; library ops (context): {esc(library)}" if library else "")
                     if mo["exported"] else f"export failed: {esc(mo['error'])}") + "</p>")
    return "".join(parts)


@section("bench_memory", "Memory when scaling (DDP / FSDP2)",
         "torchcls bench memory --model ... --parallel ddp,fsdp2 --world-sizes 1,2,4 --out RUN_DIR", 56)
def scaling_memory(run_dir: Path) -> str | None:
    path = next(iter(sorted(run_dir.rglob("bench_memory.json"))), None)
    data = read_json(path) if path else None
    if not data:
        return None
    rows = [[r["parallel"], r["world"], k["rank"], mib(k["total_bytes"]), mib(k["expected_state_bytes"]),
             fmt(k["state_vs_world1"]) if k["state_vs_world1"] is not None else "-", mib(k["activation_bytes"]),
             mib(k["transient_bytes"]), mib(k["measured_peak_bytes"])]
            for r in data["results"] if r["status"] == "ok" for k in r["ranks"]]
    rows += [[r["parallel"], r["world"], "-", f"{r['status']}: {r['error']}", "", "", "", "", ""]
             for r in data["results"] if r["status"] != "ok"]
    parts = [f"<p>{esc(data['model'])}, {esc(data['img_size'])} px, {esc(data['batch_per_rank'])} images per rank, "
             f"{esc(data['machine']['device'])} ({esc(data['machine']['backend'])})</p>",
             table(["parallel", "world", "rank", "state", "analytic state", "state / world-1", "activations",
                    "transient", "measured peak"], rows)]
    if plots.rank_memory_bars(data["results"], run_dir / "bench_memory.png"):
        parts.append(img(run_dir / "bench_memory.png"))
    fit = data["fit"]
    parts.append(f"<h3>What fits ({esc(fit['source'])})</h3><ul>"
                 + "".join(f"<li>{esc(c['verdict'])}</li>" for c in fit["configs"])
                 + f"<li><b>{esc(fit['recommendation'])}</b></li></ul>")
    return "".join(parts)

"""report.html: the run at a glance, self-contained (images embedded), regenerated from the run dir."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from torchcls.report import plots
from torchcls.train.rundir import read_metrics

CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}
.kpi{display:inline-block;margin:0 1.5em 1em 0}.kpi b{display:block;font-size:1.6em}pre{background:#f7f7f7;padding:1em}"""


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _eval_section(ev: dict[str, Any]) -> str:
    kpis = "".join(f'<div class="kpi">{k}<b>{v}</b></div>' for k, v in (
        ("top-1", f"{ev['top1']:.2%}"), ("top-5", f"{ev['top5']:.2%}"), ("images", ev["n"]),
        ("macro F1", f"{ev['macro_f1']:.3f}"), ("calibration error", f"{ev['ece']:.3f}")))
    rows = [[c, f"{m['precision']:.3f}", f"{m['recall']:.3f}", f"{m['f1']:.3f}", m["support"]]
            for c, m in ev["per_class"].items()]
    return (f"<h2>Evaluation ({html.escape(ev['data'])}, split {html.escape(ev['split'])})</h2>{kpis}"
            + _table(["class", "precision", "recall", "F1", "support"], rows))


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    parts = [f"<h1>torchcls run: {html.escape(run_dir.name)}</h1>"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    if epochs:
        last = epochs[-1]
        parts.append(f"<p>{len(epochs)} epoch(s), {last['step']} steps, last epoch "
                     f"{last['img_per_s']:.0f} images/s.</p>")
        cols = [k for k in ("epoch", "train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "epoch_s")
                if k in last]
        parts.append("<h2>Training</h2>" + _table(cols, [[_fmt(e.get(c)) for c in cols] for e in epochs]))
    if plots.training_curves(records, run_dir / "curves.png"):
        parts.append(_img(run_dir / "curves.png"))
    eval_file = run_dir / "eval.json"
    if eval_file.is_file():
        ev = json.loads(eval_file.read_text())
        parts.append(_eval_section(ev))
        if (run_dir / "confusion_matrix.png").is_file():
            parts.append(_img(run_dir / "confusion_matrix.png"))
    if (run_dir / "samples.png").is_file():
        parts.append("<h2>Training samples</h2>" + _img(run_dir / "samples.png"))
    from torchcls.governance.report import governance_html

    parts.append(governance_html(run_dir))
        if "early_exit" in ev:
            from torchcls.report.early_exit import section

            parts.append(section(ev["early_exit"]))
            if (run_dir / "exit_curve.png").is_file():
                parts.append(_img(run_dir / "exit_curve.png"))
    for name, title in (("skipped_files.json", "Skipped training files"), ("eval.json", "Skipped evaluation files")):
        skipped = _skipped(run_dir / name)
        if skipped:
            parts.append(f"<h2>{title} ({len(skipped)})</h2>"
                         + _table(["file", "reason"], [[s["file"], s["reason"]] for s in skipped]))
    precision_file = run_dir / "precision.json"
    if precision_file.is_file():
        from torchcls.precision.report import html_section

        parts.append(html_section(json.loads(precision_file.read_text())))
    from torchcls.report.memory import memory_section

    parts.append(memory_section(run_dir))  # distributed runs: per-rank memory vs full / world
    config_file = run_dir / "config.toml"
    if config_file.is_file():
        parts.append(f"<h2>Configuration</h2><pre>{html.escape(config_file.read_text())}</pre>")
    out = run_dir / "report.html"
    out.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(run_dir.name)}</title>"
                   f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>")
    return out


def _skipped(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    return data.get("skipped_files", []) if isinstance(data, dict) else []


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)

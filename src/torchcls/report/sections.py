"""Report sections: each renders its part of report.html from files in the run dir.

A section's `render(run_dir)` returns HTML, or None when its data is absent; the page
then says "not run" with the command that produces it. Add a section with `@section(...)`
in any module imported by `torchcls.report.html` (results.py holds those of the
evaluation commands), so `write_report` itself never grows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls import run_files
from torchcls.bounded_json import NotJson
from torchcls.errors import UserError
from torchcls.io_files import SMALL_JSON_BYTES
from torchcls.report import plots
from torchcls.report.htmlkit import esc, fmt, img, kpis, table
from torchcls.training.rundir import parse_record, read_metrics, read_skipped

Render = Callable[[Path], "str | None"]


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    render: Render
    how_to_run: str  # shown when the section has no data
    order: int


SECTIONS: dict[str, Section] = {}


def section(key: str, title: str, how_to_run: str, order: int) -> Callable[[Render], Render]:
    def register(render: Render) -> Render:
        SECTIONS[key] = Section(key, title, render, how_to_run, order)
        return render
    return register


def ordered() -> list[Section]:
    return sorted(SECTIONS.values(), key=lambda s: s.order)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON record `path` of the run dir, an object; None when absent or not JSON. Refused (UserError): a
    link, and JSON of another top-level type (every record torchcls writes is an object)."""
    try:
        record = parse_record(run_files.read_bytes(path, max_bytes=SMALL_JSON_BYTES, what="run record"), str(path)) \
            if os.path.lexists(path) else None
    except (OSError, json.JSONDecodeError):
        return None
    if record is not None and not isinstance(record, dict):
        raise UserError(f"{path}: a JSON {type(record).__name__}, where torchcls writes an object: not this run's "
                        "record, or damaged")
    return record


@section("training", "Training", "torchcls train", 10)
def training(run_dir: Path) -> str | None:
    records = read_metrics(run_dir)
    epochs = [r for r in records if r.get("kind") == "epoch"]
    if not epochs:
        return None
    last = epochs[-1]
    parts = [f"<p>{len(epochs)} epoch(s), {esc(last['step'])} steps, last epoch {last['img_per_s']:.0f} images/s.</p>"]
    classes = class_count(run_dir)
    cols = [k for k in ("epoch", "train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "val_map", "val_f1",
                        "epoch_s")
            if k in last and not (k == "val_top5" and classes is not None and classes <= 5)]  # 100% by definition
    parts.append(table(cols, [[_fmt4(e.get(c)) for c in cols] for e in epochs]))
    if plots.training_curves(records, run_dir / "curves.png", classes):
        parts.append(img(run_dir / "curves.png"))
    parts.append(_skipped(run_dir / "skipped_files.json", "Skipped training files"))
    return "".join(parts)


@section("evaluation", "Evaluation", "torchcls evaluate RUN_DIR", 20)
def evaluation(run_dir: Path) -> str | None:
    ev = read_json(run_dir / "eval.json")
    if not ev:
        return None
    parts = [f"<p>data {esc(ev['data'])}, split {esc(ev['split'])}</p>", kpis([
        ("top-1", f"{ev['top1']:.2%}"), ("top-5", f"{ev['top5']:.2%}"), ("images", ev["n"]),
        ("macro F1", f"{ev['macro_f1']:.3f}"), ("calibration error", f"{ev['ece']:.3f}")])]
    rows = [[c, f"{m['precision']:.3f}", f"{m['recall']:.3f}", f"{m['f1']:.3f}", m["support"]]
            for c, m in ev["per_class"].items()]
    parts.append(table(["class", "precision", "recall", "F1", "support"], rows))
    if os.path.lexists(run_dir / "confusion_matrix.png"):  # (a link is refused by img, not skipped)
        parts.append(img(run_dir / "confusion_matrix.png"))
    if isinstance(ev.get("confusion_matrix_omitted"), dict):  # too many classes (evaluator.CONFUSION_MAX_CLASSES)
        parts.append(f"<p>confusion matrix left out: {esc(str(ev['confusion_matrix_omitted'].get('reason')))}</p>")
    parts.append(_skipped(run_dir / "eval.json", "Skipped evaluation files"))
    return "".join(parts)


@section("config", "Configuration", "torchcls train (writes config.toml)", 90)
def configuration(run_dir: Path) -> str | None:
    config_file = run_dir / "config.toml"
    if not os.path.lexists(config_file):
        return None
    text = run_files.read_text(config_file, max_bytes=SMALL_JSON_BYTES, what="config file", errors="replace")
    return f"<pre>{esc(text)}</pre>"


def class_count(run_dir: Path) -> int | None:
    """How many classes the run's model has: from eval.json, else the checkpoint's metadata (None: unknown)."""
    classes = (read_json(run_dir / "eval.json") or {}).get("classes")
    if isinstance(classes, list):
        return len(classes)
    last = run_dir / "checkpoints" / "last.safetensors"
    if not run_files.is_file(last) or os.path.islink(last.parent):
        return None
    from torchcls.checkpoint.files import read_meta
    from torchcls.errors import UserError

    try:
        return len(read_meta(last).classes)
    except UserError:
        return None


def _skipped(path: Path, title: str) -> str:
    try:
        skipped = read_skipped(path, hint="take the run dir again, or remove the file to make the report without it")
    except (OSError, NotJson):  # as read_json: a record that cannot be read or was cut short shows nothing
        return ""
    if not skipped:
        return ""
    return f"<h3>{title} ({len(skipped)})</h3>" + table(["file", "reason"], [[s["file"], s["reason"]] for s in skipped])


def _fmt4(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else fmt(v)

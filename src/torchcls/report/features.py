"""Report sections of the features that write their own files into a run dir: the data
governance record, precision (FP8 layer table), per-rank memory of distributed runs,
early-exit evaluation, and the (policy-filtered) training sample grid.

Each feature renders its own HTML (with its own heading); here it is only placed on the
page, under the section's heading instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torchcls.report.htmlkit import img
from torchcls.report.sections import read_json, section


def _body(fragment: str) -> str | None:
    """Drop a feature fragment's own leading <h2> (the section supplies the heading); '' → not run."""
    return re.sub(r"^\s*<h2>.*?</h2>", "", fragment, count=1, flags=re.S) or None


@section("samples", "Training samples", "torchcls train --sample-grid N (as the data policy allows)", 15)
def samples(run_dir: Path) -> str | None:
    grid = run_dir / "samples.png"
    return img(grid) if os.path.lexists(grid) else None  # (a link is refused by img, named)


@section("precision", "Precision and machine", "torchcls train (--precision auto|fp32|bf16|fp16|fp8)", 12)
def precision(run_dir: Path) -> str | None:
    report = read_json(run_dir / "precision.json")
    if not report:
        return None
    report["machine"] = read_json(run_dir / "machine.json")  # CPU, cores, quota and threads of the run
    from torchcls.precision.summary import html_section

    return _body(html_section(report))


@section("early_exit", "Early exit", "torchcls evaluate RUN_DIR (for an ee/ model)", 25)
def early_exit(run_dir: Path) -> str | None:
    ev = read_json(run_dir / "eval.json") or {}
    if "early_exit" not in ev:
        return None
    from torchcls.report.exit_curve import section as early_exit_html

    curve = run_dir / "exit_curve.png"
    return (_body(early_exit_html(ev["early_exit"])) or "") + (img(curve) if os.path.lexists(curve) else "")


@section("rank_memory", "Per-rank memory", "torchrun ... -m torchcls train --parallel ddp|fsdp2", 55)
def rank_memory(run_dir: Path) -> str | None:
    from torchcls.report.memory_table import memory_section

    fragment = memory_section(run_dir)
    return fragment or None  # its heading names the mode and world size: keep it


@section("governance", "Data governance", "torchcls train (records lineage unless --no-lineage)", 70)
def governance(run_dir: Path) -> str | None:
    from torchcls.governance.report_section import governance_html

    return _body(governance_html(run_dir))

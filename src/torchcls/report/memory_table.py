"""The report's per-rank memory table (from memory.json, written by distributed runs)."""

from __future__ import annotations

import html
import os
from pathlib import Path

from torchcls import run_files
from torchcls.bounded_json import load_bounded
from torchcls.io_files import SMALL_JSON_BYTES
from torchcls.training.rundir import RUN_RECORD


def _mb(v: float | None) -> str:
    return "" if v is None else f"{v / 2**20:.2f}"


def memory_section(run_dir: Path) -> str:
    path = run_dir / "memory.json"
    if not os.path.lexists(path):
        return ""
    m = load_bounded(run_files.read_bytes(path, max_bytes=SMALL_JSON_BYTES, what="memory.json"), RUN_RECORD, str(path))
    cuda = any("cuda_peak_allocated_bytes" in r for r in m["ranks"])
    head = ["rank", "params MB", "grads MB", "optimizer MB", "total MB", "expected MB (analytic)",
            "peak RSS MB"] + (["CUDA peak MB", "CUDA reserved MB"] if cuda else [])
    rows = []
    for r in m["ranks"]:
        row = [r["rank"], _mb(r["param_bytes"]), _mb(r["grad_bytes"]), _mb(r["optimizer_bytes"]),
               _mb(r["total_bytes"]), _mb(r["expected_total_bytes"]), _mb(r["peak_rss_bytes"])]
        if cuda:
            row += [_mb(r.get("cuda_peak_allocated_bytes")), _mb(r.get("cuda_peak_reserved_bytes"))]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    rule = "full size / world size" if m["parallel"] == "fsdp2" else "full size (every rank holds a replica)"
    return (f"<h2>Per-rank memory ({html.escape(m['parallel'])}, world size {html.escape(str(m['world_size']))})</h2>"
            f"<p>Parameters + gradients + optimizer state of the full model: {_mb(m['full_total_bytes'])} MB; "
            f"expected per rank: {rule}.</p><table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
            + "".join(rows) + "</table>")

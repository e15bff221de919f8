"""The precision choice and the per-layer FP8 eligibility report: printed at the start of a run
and rendered into report.html from precision.json."""

from __future__ import annotations

import html
from collections import defaultdict
from typing import Any

SHOWN_NAMES = 6  # per group in the console; precision.json and report.html list every layer


def headline(report: dict[str, Any]) -> str:
    chosen = f" ({report['requested']}: {report['reason']})" if report.get("requested", "") == "auto" else ""
    parts = [f"precision {report['precision']}{chosen}", f"device {report['device']}",
             f"autocast {report['autocast_dtype'] or 'off'}", f"master weights {report['master_weights']}"]
    if report["grad_scaler"]:
        parts.append("grad scaler on")
    if report["compile"]:
        parts.append("torch.compile on")
    parts.append(f"non-finite loss: {report['nonfinite']}")
    return ", ".join(parts)


def fp8_lines(fp8: dict[str, Any]) -> list[str]:
    lines = [f"FP8 {fp8['backend_recipe']} ({fp8['hardware']}): converted {fp8['converted']} of "
             f"{fp8['linear_layers']} Linear layers (size rule: {fp8['size_rule']})"]
    groups: dict[str, list[str]] = defaultdict(list)
    for layer in fp8["layers"]:
        key = "converted" if layer["converted"] else f"skipped: {_generic(layer['reason'])}"
        groups[key].append(layer["name"] or "<model>")
    for key, names in groups.items():
        more = f", ... (+{len(names) - SHOWN_NAMES})" if len(names) > SHOWN_NAMES else ""
        lines.append(f"  {key} ({len(names)}): {', '.join(names[:SHOWN_NAMES])}{more}")
    return lines


def _generic(reason: str) -> str:
    """Group reasons by their kind, not by each layer's numbers."""
    if "not divisible by 16" in reason:
        return "dims not divisible by 16"
    if reason.startswith("too small"):
        return "too small for FP8 to pay"
    return reason


def print_precision(report: dict[str, Any]) -> None:
    from torchcls.console import console

    console.print(headline(report), highlight=False)
    if report.get("compile_note"):
        console.print(f"torch.compile {report['compile_note']}", highlight=False)
    if report.get("fp8"):
        for line in fp8_lines(report["fp8"]):
            console.print(line, highlight=False, markup=False)


def html_section(report: dict[str, Any]) -> str:
    parts = [f"<h2>Precision</h2><p>{html.escape(headline(report))}</p>"]
    if report.get("warning"):
        parts.append(f"<p>warning: {html.escape(report['warning'])}</p>")
    if report.get("machine"):
        from torchcls.machine import machine_line

        parts.append(f"<p>machine: {html.escape(machine_line(report['machine']))}</p>")
    fp8 = report.get("fp8")
    if fp8:
        parts.append(f"<p>{html.escape(fp8_lines(fp8)[0])}</p>")
        rows = "".join(
            f"<tr><td>{html.escape(d['name'] or '<model>')}</td><td>{html.escape(d['type'])}</td>"
            f"<td>{html.escape(str(d['in_features']))}</td><td>{html.escape(str(d['out_features']))}</td><td>{'yes' if d['converted'] else 'no'}</td>"
            f"<td>{html.escape(d['reason'])}</td></tr>" for d in fp8["layers"])
        parts.append("<table><tr><th>layer</th><th>type</th><th>in</th><th>out</th><th>FP8</th><th>why</th></tr>"
                     f"{rows}</table>")
    return "".join(parts)

"""How the CLI shows results: the evaluation summary and the prediction table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def version_line() -> str:
    """torchcls's version and the torch it runs on: the pair a bug report needs (read from the installed
    metadata, so --help and --version stay fast: torch is not imported)."""
    import sys
    from importlib.metadata import version

    from torchcls.version import __version__

    return f"torchcls {__version__} (torch {version('torch')}, Python {sys.version.split()[0]})"


def evaluation_lines(r: dict[str, Any]) -> list[str]:
    if r.get("task") == "multilabel":
        return [f"{r['data']} [{r['split']}]: mAP {r['map']:.4f}  F1 {r['f1_tuned']:.4f} at the saved thresholds "
                f"({r['f1']:.4f} at 0.5)  exact match {r['exact_match']:.4f}  n {r['n']}",
                f"wrote {Path(r['out_dir']) / 'eval.json'}"]
    lines = [f"{r['data']} [{r['split']}]: top1 {r['top1']:.4f}  top5 {r['top5']:.4f}  n {r['n']}  "
             f"macro-F1 {r['macro_f1']:.4f}  ECE {r['ece']:.4f}", f"wrote {Path(r['out_dir']) / 'eval.json'}"]
    if "early_exit" in r:
        ee = r["early_exit"]
        lines.append(
            f"early exit: threshold {ee['threshold']:.4g}  accuracy {ee['accuracy']:.4f} (backbone "
            f"{ee['backbone_accuracy']:.4f})  exits {' / '.join(f'{f:.1%}' for f in ee['exit_fractions'])}  "
            f"{ee['mean_flops'] / 1e6:.2f} MFLOP/image ({ee['relative_compute']:.0%} of the backbone)  "
            f"{ee['latency_ms_per_sample']:.2f} ms/image (backbone {ee['backbone_latency_ms_per_sample']:.2f})")
    return lines


def print_models(entries, as_json: bool) -> int:
    """One name a line (grep-able), grouped by family; pretrained tags with their hub form and cache state."""
    if as_json:
        print(json.dumps([e.as_dict() for e in entries], indent=2))
        return 0
    tags = any(e.pretrained for e in entries)  # a pretrained listing: show each tag's hub form
    for e in entries:
        hub = (e.pretrained or "(no hub copy)") + ("  [in cache]" if e.cached else "") if tags else ""
        print(f"{e.name:<44}{e.family:<12}{hub}".rstrip())
    cached = sum(e.cached for e in entries)
    print(f"{len(entries)} model(s)" + (f", {cached} with weights in the local hub cache" if cached else ""))
    return 0


def export_lines(r) -> list[str]:
    """What `torchcls export` prints: the artifact, its parity, and the target's own details (edge.describe)."""
    from torchcls.artifacts.edge import describe

    p = r.parity
    quantized = p.get("executorch", {}).get("quantize") not in (None, "none")  # int8 weights and activations
    runtime = " on OpenVINO" if r.info.runtime == "openvino" else ""
    kind = f"{r.info.target}{runtime} {p['executorch']['quantize'] if quantized else r.info.precision}"
    lines = [f"wrote {r.path} ({r.path.stat().st_size / 1e6:.1f} MB, {kind}, batch 1-{r.info.max_batch})",
             f"parity on {p['n']} held-out images: top-1 agreement {p['top1_agreement']:.4f}, "
             f"max |dlogit| {p['max_abs_diff']:.3g} -> {r.parity_path}"]
    if details := describe(p):  # ExecuTorch lowering, early-exit parity per exit
        lines.append(details)
    return lines


def print_predictions(preds, topk: int) -> None:
    from rich.table import Table

    from torchcls.console import console

    if any("labels" in item for item in preds.items):  # multilabel: every label above its threshold, then top-k
        table = Table("file", "labels", *(f"#{i}" for i in range(1, max(len(i["top"]) for i in preds.items) + 1)))
        rows = [[item["file"], "; ".join(f"{t['label']} {t['prob']:.3f}" for t in item["labels"]) or "-",
                 *(f"{t['label']} {t['prob']:.3f}" for t in item["top"])] for item in preds.items]
    else:
        table = Table("file", "label", "probability", *(f"#{i}" for i in range(2, topk + 1)))
        rows = [[item["file"], item["top"][0]["label"], f"{item['top'][0]['prob']:.3f}",
                 *(f"{t['label']} {t['prob']:.3f}" for t in item["top"][1:])] for item in preds.items]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for s in preds.skipped:
        console.print(f"[yellow]skipped {s['file']}: {s['reason']}[/]")

"""Early-exit parts of the run report: the accuracy-vs-compute curve and a summary section."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from torchcls.report import plots  # noqa: F401  (sets the Agg backend)


def accuracy_compute_curve(ev: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    curve = sorted(ev["curve"], key=lambda p: p["mean_flops"])
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot([p["mean_flops"] / 1e6 for p in curve], [p["accuracy"] for p in curve], marker=".", label="early exit")
    ax.axhline(ev["backbone_accuracy"], color="grey", ls="--", label="backbone without exits")
    ax.axvline(ev["backbone_flops"] / 1e6, color="grey", ls=":")
    ax.scatter([ev["mean_flops"] / 1e6], [ev["accuracy"]], color="red", zorder=3,
               label=f"threshold {ev['threshold']:.4g}")
    for p in curve[:: max(1, len(curve) // 6)]:
        ax.annotate(f"{p['threshold']:.3g}", (p["mean_flops"] / 1e6, p["accuracy"]), fontsize=7,
                    textcoords="offset points", xytext=(3, -9))
    ax.set(xlabel="mean MFLOP per image", ylabel="accuracy", title="Accuracy vs compute (exit threshold sweep)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plots.save_figure(fig, path, dpi=110)


def section(ev: dict[str, Any]) -> str:
    kpis = "".join(f'<div class="kpi">{k}<b>{v}</b></div>' for k, v in (
        ("threshold", f"{ev['threshold']:.4g}"), ("accuracy", f"{ev['accuracy']:.2%}"),
        ("backbone accuracy", f"{ev['backbone_accuracy']:.2%}"),
        ("mean compute", f"{ev['mean_flops'] / 1e6:.2f} MFLOP ({ev['relative_compute']:.0%})"),
        ("latency / image", f"{ev['latency_ms_per_sample']:.2f} ms (backbone "
                            f"{ev['backbone_latency_ms_per_sample']:.2f})")))
    rows = "".join(f"<tr><td>exit {k}</td><td>{f:.2%}</td><td>{flops / 1e6:.2f}</td></tr>"
                   for k, (f, flops) in enumerate(zip(ev["exit_fractions"], ev["exit_path_flops"])))
    cal = ev.get("calibration")
    note = ""
    if cal:
        target = (f"accuracy ≥ {cal['target_accuracy']}" if cal["target_accuracy"] is not None
                  else f"compute ≤ {cal['target_compute']} of the backbone")
        note = f"<p>Threshold calibrated on the validation split ({html.escape(str(cal['n']))} images) for {html.escape(target)}" + (
            ": no threshold reaches it, the nearest one is used.</p>" if cal.get("reached") is False else ".</p>")
    return (f"<h2>Early exit</h2>{kpis}{note}<table><tr><th>exit</th><th>samples leaving</th>"
            f"<th>MFLOP to leave here</th></tr>{rows}</table>")

"""Matplotlib figures for the run report (Agg backend: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from torchcls import run_files
from torchcls.io_files import SMALL_JSON_BYTES

MAX_TICK_LABELS = 60  # class names on a confusion matrix's axes: at 14 in, more overlap
MAX_CELL_COUNTS = 30  # counts written in its cells
# No count of records read from a file sizes a canvas: a received bench_compile.json of 76,000 rows (6 MB)
# sized a 1.1 in-per-bar figure into a 12.7 GB canvas. A bar chart draws the first MAX_BARS records (its
# title says how many of all; the section's table lists every one), and every figure is clamped to
# MAX_FIGURE_INCHES, where it is made (`subplots`: tight_layout renders at that size) and where it is saved.
MAX_BARS = 100
MAX_FIGURE_INCHES = (40.0, 20.0)  # width, height: at most 4,400 x 2,200 px at the report's 110 dpi


def subplots(width: float, height: float, **kwargs):
    """plt.subplots with figsize (width, height) held to MAX_FIGURE_INCHES: every figure here is made by it."""
    return plt.subplots(figsize=_clamped(width, height), **kwargs)


def _clamped(width: float, height: float) -> tuple[float, float]:
    return min(float(width), MAX_FIGURE_INCHES[0]), min(float(height), MAX_FIGURE_INCHES[1])


def _bars(records: list, what: str) -> tuple[list, str]:
    """The records a bar chart draws (the first MAX_BARS), and a note for its title when some are left out."""
    if len(records) <= MAX_BARS:
        return records, ""
    return records[:MAX_BARS], f" (first {MAX_BARS} of {len(records):,} {what}; all in the table)"


def save_figure(fig, path: Path, dpi: int) -> None:
    """Save and close `fig` as `path`, a run dir's file: the name is replaced, never written through a link.
    A figure made elsewhere than `subplots` is held to MAX_FIGURE_INCHES here all the same."""
    try:
        size = tuple(fig.get_size_inches())
        if _clamped(*size) != size:
            fig.set_size_inches(*_clamped(*size))
        run_files.replace_file(path, lambda tmp: fig.savefig(tmp, dpi=dpi))
    finally:
        plt.close(fig)


def curve_lines(records: list[dict[str, Any]], classes: int | None = None) -> tuple[list[dict], list[dict]]:
    """The lines of the two training panels, (loss, accuracy): each {label, x, y, style}. A line of one point
    is left out (it draws nothing, and its legend entry would name nothing visible); with `classes` <= 5,
    top-5 is 100% by definition and is left out too."""
    epochs = [r for r in records if r.get("kind") == "epoch"]
    steps = [r for r in records if r.get("kind") == "step"]
    loss, accuracy = [], []
    if len(steps) > 1:
        spe = max(1, epochs[0]["step"]) if epochs else 1  # steps per epoch, to put steps on the epoch axis
        loss.append({"label": "step loss", "x": [s["step"] / spe for s in steps], "y": [s["loss"] for s in steps],
                     "style": {"alpha": 0.35}})
    epoch_style = {"marker": "o"}  # markers: a run of one epoch still shows its point
    for key, label in (("train_loss", "train loss"), ("val_loss", "val loss")):
        if epochs and key in epochs[0]:
            loss.append({"label": label, "x": [e["epoch"] for e in epochs], "y": [e[key] for e in epochs],
                         "style": epoch_style})
    for key, label in (("train_top1", "train top-1"), ("val_top1", "val top-1"), ("val_top5", "val top-5"),
                       ("val_map", "val mAP (multilabel)"), ("val_f1", "val F1 at 0.5")):
        if epochs and key in epochs[0] and not (key == "val_top5" and classes is not None and classes <= 5):
            accuracy.append({"label": label, "x": [e["epoch"] for e in epochs], "y": [e[key] for e in epochs],
                             "style": epoch_style})
    return loss, accuracy


def training_curves(records: list[dict[str, Any]], path: Path, classes: int | None = None) -> bool:
    """Loss and accuracy per epoch (and per-step loss), see curve_lines; False when there is nothing to plot."""
    loss, accuracy = curve_lines(records, classes)
    if not loss and not accuracy:
        return False
    fig, (ax_loss, ax_acc) = subplots(10, 3.8, nrows=1, ncols=2)
    for ax, lines in ((ax_loss, loss), (ax_acc, accuracy)):
        for line in lines:
            ax.plot(line["x"], line["y"], label=line["label"], **line["style"])
    ax_loss.set(xlabel="epoch", ylabel="loss", title="Loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="Accuracy")
    for ax, lines in ((ax_loss, loss), (ax_acc, accuracy)):
        ax.grid(alpha=0.3)
        if lines:
            ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return True


def confusion_matrix(matrix: list[list[int]], classes: list[str], path: Path) -> None:
    """The matrix as an image; class names on its axes only up to MAX_TICK_LABELS classes (more would
    overlap into a black band), counts in its cells only up to MAX_CELL_COUNTS."""
    n = len(classes)
    size = min(14, 2.5 + 0.45 * n)
    fig, ax = subplots(size, size)
    im = ax.imshow(matrix, cmap="Blues")
    ax.set(xlabel="predicted", ylabel="true", title="Confusion matrix")
    if n <= MAX_TICK_LABELS:
        ax.set(xticks=range(n), yticks=range(n))
        ax.set_xticklabels(classes, rotation=45, ha="right")
        ax.set_yticklabels(classes)
    else:  # matplotlib's few numeric ticks: class indices
        ax.set(xlabel="predicted (class index)", ylabel="true (class index)")
    if n <= MAX_CELL_COUNTS:
        top = max(max(row) for row in matrix) or 1
        for i in range(n):
            for j in range(n):
                ax.text(j, i, matrix[i][j], ha="center", va="center", fontsize=7,
                        color="white" if matrix[i][j] > top / 2 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def memory_curves(report: dict[str, Any], run_dir: Path, path: Path) -> bool:
    """CUDA: allocated / reserved / inactive-split per step. CPU: the profiler's memory timeline by category."""
    cuda = report["allocator"]["available"] and report.get("samples")
    if not cuda:
        name = report.get("profiler", {}).get("timeline_file")  # (allocator.json names it: a run dir's word)
        timeline = run_files.inside(run_dir, name, "memory timeline") if name is not None else None
        if timeline is None or not os.path.lexists(timeline):
            return False
    fig, ax = subplots(9, 3.6)
    if cuda:
        s = report["samples"]
        for key in ("allocated", "reserved", "inactive_split"):
            ax.plot([x["step"] for x in s], [x[key] / 2**20 for x in s], label=key)
        ax.set(xlabel="step", ylabel="MiB", title="CUDA caching allocator")
    else:
        from torchcls.memory.cpu_profile import TIMELINE_CATEGORIES, read_timeline

        times, sizes = read_timeline(run_files.read_bytes(timeline, max_bytes=SMALL_JSON_BYTES, what="memory timeline"),
                                     str(timeline))
        if not times:
            plt.close(fig)
            return False
        t0 = times[0]
        ax.stackplot([(t - t0) / 1000 for t in times],
                     [[row[i + 1] / 2**20 for row in sizes] for i in range(len(TIMELINE_CATEGORIES))],
                     labels=TIMELINE_CATEGORIES)
        ax.set(xlabel="ms (profiled steps)", ylabel="MiB", title="CPU memory by category (profiler)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    return True


def compile_speedups(results: list[dict[str, Any]], path: Path) -> bool:
    """Compiled-vs-eager speedup per configuration (bars), 1× marked."""
    ok, left_out = _bars([r for r in results if r.get("speedup")], "configurations")
    if not ok:
        return False
    labels = [f"{r['model']}\nb{r['batch']} {r['precision']} {r['mode']}" for r in ok]
    fig, ax = subplots(max(6, 1.1 * len(ok)), 3.8)
    ax.bar(range(len(ok)), [r["speedup"] for r in ok], color=["#2a7" if r["speedup"] >= 1 else "#c44" for r in ok])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(ok)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set(ylabel="speedup (eager / compiled latency)", title="torch.compile gains" + left_out)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    return True


def rank_memory_bars(results: list[dict[str, Any]], path: Path) -> bool:
    """Per-rank parameter / gradient / optimizer bytes per (parallel, world) job (stacked bars), with
    the analytic expectation marked: FSDP2's bars should shrink as 1/world, DDP's stay level."""
    bars, left_out = _bars([(f"{r['parallel']}×{r['world']}\nrank {k['rank']}", k) for r in results
                            if r["status"] == "ok" for k in r["ranks"]], "ranks")
    if not bars:
        return False
    fig, ax = subplots(max(6, 0.7 * len(bars)), 3.8)
    xs, bottom = range(len(bars)), [0.0] * len(bars)
    for key, label in (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optimizer_bytes", "optimizer")):
        heights = [k[key] / 2**20 for _, k in bars]
        ax.bar(xs, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.scatter(xs, [k["expected_state_bytes"] / 2**20 for _, k in bars], marker="_", s=400, color="k",
               label="analytic", zorder=3)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([label for label, _ in bars], fontsize=7)
    ax.set(ylabel="MiB per rank", title="Training state per rank" + left_out)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    return True

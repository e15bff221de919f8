"""The report's side of the core's events (torchcls.events): what a finished run and an evaluation add.

A finished run gets its report.html (rank 0); an evaluation gets its figures (the confusion matrix, an
early-exit model's accuracy-vs-compute curve) and, in a run dir, a refreshed report.html.
"""

from __future__ import annotations

import os

from torchcls.events import EvaluationWritten, RunFinished
from torchcls.io_errors import writing
from torchcls.report import plots
from torchcls.report.exit_curve import accuracy_compute_curve
from torchcls.report.html import write_report


def on_run_finished(event: RunFinished) -> None:
    if event.is_main:
        with writing(event.run_path / "report.html"):  # a full disk is told as such, naming the file
            write_report(event.run_path)


def on_evaluation_written(event: EvaluationWritten) -> None:
    out, result = event.out_dir, event.result
    if "early_exit" in result:
        accuracy_compute_curve(result["early_exit"], out / "exit_curve.png")
    if "confusion_matrix" in result:  # multiclass
        plots.confusion_matrix(result["confusion_matrix"], event.classes, out / "confusion_matrix.png")
    if os.path.lexists(out / "config.toml"):  # a run dir (its report reads no link: run_files)
        write_report(out)

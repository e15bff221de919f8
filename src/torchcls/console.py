"""One rich console for everything torchcls prints, and the progress bar."""

from __future__ import annotations

import contextlib

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# soft_wrap: a line is never broken at the console width. Outside a terminal rich assumes 80
# columns, which split epoch lines in logs and CI ("val top1 \n98.60%").
console = Console(highlight=False, soft_wrap=True)


class _NoBar:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass


def progress_bar(enabled: bool):
    if not enabled:
        return contextlib.nullcontext(_NoBar())
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=True)

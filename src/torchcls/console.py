"""One rich console for everything torchcls prints, and the progress bar."""

from __future__ import annotations

import contextlib

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# soft_wrap: a line is never broken at the console width. Outside a terminal rich assumes 80
# columns, which split epoch lines in logs and CI ("val top1 \n98.60%").
console = Console(highlight=False, soft_wrap=True)


class _NoBar:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass


_phases: tuple[Progress, int, str] | None = None  # the live display of phases() while one is open


@contextlib.contextmanager
def phases(title: str):
    """While a long command runs (an export: 20-80 s of building), show on a terminal `title: <phase>` with a
    spinner and the elapsed time; the line goes away at the end. Not on a terminal (logs, CI, pipes): nothing."""
    global _phases
    if not console.is_terminal:
        yield
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        _phases = (bar, bar.add_task(title), title)
        try:
            yield
        finally:
            _phases = None


def phase(name: str) -> None:
    """Name the phase now running in the open phases() display (no-op when there is none)."""
    if _phases is not None:
        bar, task, title = _phases
        bar.update(task, description=f"{title}: {name}")


def progress_bar(enabled: bool):
    if not enabled:
        return contextlib.nullcontext(_NoBar())
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=True)

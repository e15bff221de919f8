"""Unreadable files found before training, under --on-bad-file error: every one named in one message.

Files are checked in stages: headers when a source is opened, size limits once the model's input
is known, a validation set of its own, full decodes when the data is cached in memory. A refusal at
the first stage that found something named some of the bad files and left the rest for later runs.
Inside `collect()`, a stage that finds bad files records them and leaves them out (as `skip` would),
so that the later stages still check the rest; the refusal comes once, when the block ends, naming
every file. Outside any `collect()` a stage refuses at once: the safe default for any other caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from torchcls.errors import UserError

Found = list[tuple[str, str]]  # (file, reason)
SHOWN = 100  # files named in the message; the count covers the rest
_pending: ContextVar[list[tuple[str, Found]] | None] = ContextVar("torchcls_bad_files", default=None)


class BadFilesError(UserError):
    def __init__(self, found: list[tuple[str, Found]]):
        self.found = found
        total = sum(len(bad) for _, bad in found)
        lines, shown = [], 0
        for where, bad in found:
            lines.append(f"  {where}:")
            for file, reason in bad[:max(0, SHOWN - shown)]:
                lines.append(f"    {file}: {reason}")
            shown += min(len(bad), max(0, SHOWN - shown))
        more = f"\n  ... and {total - shown:,} more" if total > shown else ""
        super().__init__(f"{total} unreadable image file(s):\n" + "\n".join(lines) + more + "\nFix or remove them, "
                         "or pass --on-bad-file skip to leave them out (each is then listed in the report).")


@contextlib.contextmanager
def collect() -> Iterator[None]:
    """Gather the refusals of every stage inside the block; raise one BadFilesError at its end."""
    if _pending.get() is not None:  # nested: the outermost block refuses
        yield
        return
    token = _pending.set([])
    try:
        yield
        found = _pending.get()
    finally:
        _pending.reset(token)
    if found:
        raise BadFilesError(found)


def refuse(bad: Found, on_bad_file: str, where: str, *, nothing_left: bool = False) -> None:
    """A stage's bad files: nothing under `skip`; under `error`, recorded for the enclosing collect() (the
    caller leaves them out and goes on), or refused at once outside one, or when `nothing_left` to go on with."""
    if not bad or on_bad_file != "error":
        return
    pending = _pending.get()
    if pending is None or nothing_left:
        raise BadFilesError([*(pending or []), (where, bad)])
    pending.append((where, bad))

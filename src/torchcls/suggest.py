"""'Did you mean ...?' for a mistyped name: a flag, a command, a data set or a folder (difflib)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice most like `word`, or None when none is close (difflib's ratio >= 0.6)."""
    found = difflib.get_close_matches(word, list(choices), n=1)
    return found[0] if found else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)', or '' when nothing is close."""
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""


def data_names(source: str, builtin: Iterable[str]) -> list[str]:
    """What `--data SOURCE` could have meant: the built-in sets, and the folders and .csv files beside
    where SOURCE points (one directory listing: cheap even for a large data set's parent)."""
    path = Path(source)
    parent = path.parent if str(path.parent) not in ("", ".") else Path(".")
    try:
        near = [p for p in parent.iterdir() if p.is_dir() or p.suffix.lower() == ".csv"]
    except OSError:
        near = []
    shown = [str(p) if parent != Path(".") else p.name for p in near]
    return [*builtin, *(s for s in shown if not Path(s).name.startswith("."))]

"""Files that fail to decode inside a DataLoader worker: left out of their batch, logged, reported.

Workers are separate processes, so a skip cannot be appended to a list the trainer sees.
Each skip is one JSON line appended (O_APPEND, one write below PIPE_BUF: atomic across
processes) to a per-rank file in the run dir; the main process reads them back at the end.
Under --on-bad-file error the worker raises `BadSampleError` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.utils.data import default_collate

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.io_files import open_regular
from torchcls.run_files import append_text

SKIP_LOG_GLOB = "decode_skips.rank*.jsonl"


class BadSampleError(UserError):
    """A file that failed to decode during an epoch, under --on-bad-file error."""

    def __init__(self, message: str):
        # DataLoader re-raises a worker's exception as `type(e)(text with the worker's traceback)`:
        # keep only our own last line, so the user sees the file and the fix, not a traceback.
        if message.startswith("Caught BadSampleError"):
            tail = message.rstrip().rsplit("\n", 1)[-1]
            message = tail.split("BadSampleError: ", 1)[-1]
        super().__init__(message)


def skip_log_path(run_dir: str | Path, rank: int = 0) -> Path:
    return Path(run_dir) / f"decode_skips.rank{rank}.jsonl"


def record_skip(log: Path, file: str, reason: str) -> None:
    # One append of one line (workers share the log), never through a link in a received run dir.
    append_text(log, json.dumps({"file": file, "reason": reason[:1000]}) + "\n", what="skip log")


MAX_SKIP_LINE = 16 << 10  # a record: a path (< 4,096 bytes) and a reason cut to 1,000 characters
MAX_SKIP_LOG_BYTES = 1 << 30  # one rank's log: ~5 million skips
SKIP_LINE = JsonBounds(max_bytes=MAX_SKIP_LINE, max_values=64, max_depth=2, max_str=MAX_SKIP_LINE)  # {file, reason}


def read_skips(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every file skipped at decode time, by any rank and worker: {"file", "reason", "times"}. Read a line at a
    time, each at most MAX_SKIP_LINE bytes (a longer one is passed over in pieces, never held)."""
    found: dict[str, dict[str, Any]] = {}
    for log in sorted(Path(run_dir).glob(SKIP_LOG_GLOB)):
        with open_regular(log, "rb", what="skip log", max_bytes=MAX_SKIP_LOG_BYTES) as f:
            for rec in _records(f):
                entry = found.setdefault(rec["file"], {"file": rec["file"], "reason": rec["reason"], "times": 0})
                entry["times"] += 1  # the same file is met again each epoch
    return list(found.values())


def _records(f: BinaryIO) -> Iterator[dict[str, Any]]:
    """The well-formed records of a skip log: a line cut by a crash, or one that is not a record, is passed over."""
    whole = True  # whether the last piece read ended its line
    for piece in iter(lambda: f.readline(MAX_SKIP_LINE + 1), b""):
        complete, whole = whole, piece.endswith(b"\n")
        if not complete or len(piece) > MAX_SKIP_LINE:
            continue
        try:
            rec = load_bounded(piece, SKIP_LINE, "skip log")
        except UserError:  # not JSON, or past SKIP_LINE (nested: json would end in a RecursionError)
            continue
        if isinstance(rec, dict) and isinstance(rec.get("file"), str) and isinstance(rec.get("reason"), str):
            yield rec


class DropBad:
    """collate_fn: leaves out the samples a dataset returned as None (skipped bad files).

    A batch whose samples were all bad becomes an empty batch of the right shape
    (the training loop should skip a batch with len(y) == 0)."""

    def __init__(self, sample_shape: tuple[int, ...] | None):
        self.sample_shape = sample_shape

    def __call__(self, batch: list) -> Any:
        kept = [b for b in batch if b is not None]
        if kept or self.sample_shape is None:
            return default_collate(kept)
        return torch.empty((0, *self.sample_shape)), torch.empty(0, dtype=torch.int64)

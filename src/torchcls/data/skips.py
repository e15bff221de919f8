"""Files that fail to decode inside a DataLoader worker: left out of their batch, logged, reported.

Workers are separate processes, so a skip cannot be appended to a list the trainer sees.
Each skip is one JSON line appended (O_APPEND, one write below PIPE_BUF: atomic across
processes) to a per-rank file in the run dir; the main process reads them back at the end.
Under --on-bad-file error the worker raises `BadSampleError` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from torchcls.errors import UserError
from torchcls.io_files import open_regular

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
    line = (json.dumps({"file": file, "reason": reason[:1000]}) + "\n").encode()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_skips(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every file skipped at decode time, by any rank and worker: {"file", "reason", "times"}."""
    found: dict[str, dict[str, Any]] = {}
    for log in sorted(Path(run_dir).glob(SKIP_LOG_GLOB)):
        with open_regular(log, "r", what="skip log", errors="replace") as f:
            lines = f.read().splitlines()
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash: the rest are still good
                continue
            entry = found.setdefault(rec["file"], {"file": rec["file"], "reason": rec["reason"], "times": 0})
            entry["times"] += 1  # the same file is met again each epoch
    return list(found.values())


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

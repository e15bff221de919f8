"""Failed writes, told apart from other errors whatever did the writing.

A write into a run dir can fail as a plain OSError (open: EACCES, EROFS), an OSError that names no
file (ENOSPC or EFBIG at write or close), a SafetensorError that only mentions the OS error in its
text, a RuntimeError from torch.save's C++ writer that does not mention it at all, or a DCP
CheckpointException that carries each rank's exception. `writing(path)` turns every one of them into
a `WriteError` naming the file that was being written, so that the run can tell the user which path
failed and that its last checkpoint is intact (training/rundir.py), instead of a traceback.
"""

from __future__ import annotations

import errno
import io
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The errors that say "this file system will not take this write", as opposed to a bug.
WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG,
                          errno.EISDIR, errno.ENOTDIR, errno.EIO})


class WriteError(OSError):
    """An OS error while writing `filename` (the file meant, not a temporary one); `detail` is the path the
    OS error itself named, when it named another one (a temporary file, a shard, a parent folder)."""

    detail: str | None = None


def os_error_of(exc: BaseException | None) -> OSError | None:
    """The OS error behind `exc` (itself, its cause or context, a rank's exception inside a DCP
    CheckpointException, or an "(os error N)" in its text), or None."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if found := re.search(r"\(os error (\d+)\)", str(e)):  # Rust's io::Error (safetensors)
            return OSError(int(found[1]), os.strerror(int(found[1])))
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            stack.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        stack.extend((e.__cause__, e.__context__))
    return None


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Raise any failure of the writes inside as a WriteError naming `path`, when an OS error is behind it."""
    try:
        yield
    except WriteError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        err = os_error_of(e)
        if err is None or err.errno is None:
            raise
        failure = WriteError(err.errno, err.strerror or os.strerror(err.errno), str(path))
        failure.detail = str(err.filename) if err.filename and str(err.filename) != str(path) else None
        raise failure from e


class RecordingFile(io.RawIOBase):
    """A binary file for torch.save that keeps the OSError of a failed write: torch's C++ writer reports
    only "unexpected pos" when a write fails, so the reason (disk full, file too large) would be lost."""

    def __init__(self, f):
        super().__init__()
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

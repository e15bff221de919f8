"""Opening a file named by input: only a regular file is ever read.

A path a user, a config, a run dir or an upload names can be a FIFO (open() blocks until a writer
comes; a read blocks until it writes), a socket, a device (/dev/zero reads forever, /dev/tty takes
the terminal, a tape rewinds on open) or a directory, or a symlink to any of these. A check by name
(`Path.is_file()`) followed by an open by name is a race, and most of the readers here did not even
check. `open_regular` opens first, without blocking, then asks the open file what it is: the check
and the read are about the same inode, whatever is renamed or linked in between.

Every reader of a path from input goes through this module (docs/security.md lists them):
`open_regular` for a file object, `read_bytes`/`read_text` for a whole file under a size bound
checked before any read, `regular_path` for libraries that take only a path (safetensors, the
torch.export loaders): the path they get is the checked open file itself (/proc/self/fd/N on Linux).
Only OS errors other than "not a regular file" (ENOENT, EACCES) are raised as they are, so callers'
own messages for a missing file keep working.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torchcls.errors import UserError

# O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer. O_NOCTTY: a terminal
# device never becomes this process's controlling terminal by being opened.
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
_PROC_FD = Path("/proc/self/fd")
# The bound for the small JSON records a run dir, a cache or the user hands back to torchcls (loader state,
# step choice, machine.json, memory figures, an FP8 table...): kilobytes in practice, parsed whole.
SMALL_JSON_BYTES = 16 << 20


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words ("a FIFO", "a directory", ...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _kind_by_name(path: str | os.PathLike) -> str:
    try:
        return kind_of(os.stat(path).st_mode)
    except OSError:
        return "not a regular file"


def _a(what: str) -> str:
    """`what` with its article: "a checkpoint", "an audit log", "a .pt2 artifact"."""
    return f"{'an' if what[:1].lower() in 'aeiou' else 'a'} {what}"


def _refusal(path: str | os.PathLike, what: str, kind: str) -> UserError:
    return UserError(f"{path}: {_a(what)} must be a regular file, and this is {kind}: only regular files are read "
                     "(a FIFO, socket, device or directory could block or never end); name the file itself")


def open_fd(path: str | os.PathLike, *, what: str = "file", follow_symlinks: bool = True,
            max_bytes: int | None = None) -> int:
    """A blocking read-only descriptor of `path`, which must be a regular file (a symlink to one counts
    unless `follow_symlinks` is False) of at most `max_bytes` bytes. The caller closes it."""
    flags = _FLAGS if follow_symlinks else _FLAGS | os.O_NOFOLLOW
    try:  # a look by name first, so that a device is not even opened (opening some has effects: a tape rewinds)
        seen = os.stat(path) if follow_symlinks else os.lstat(path)
    except OSError:
        seen = None  # (the open below raises the error that says why)
    if seen is not None and not stat.S_ISREG(seen.st_mode):
        raise _refusal(path, what, kind_of(seen.st_mode))
    try:  # ... and the verdict that counts, on the open descriptor: the name may have changed meanwhile
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ENXIO:  # what opening a socket (or a device with nothing behind it) answers
            raise _refusal(path, what, _kind_by_name(path)) from None
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise _refusal(path, what, "a symbolic link (not followed here)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(path, what, kind_of(st.st_mode))
        if max_bytes is not None and st.st_size > max_bytes:
            raise UserError(f"{path}: {_a(what)} is at most {max_bytes} bytes, and this one is {st.st_size}: "
                            "is it the right file?")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike, mode: str = "rb", *, what: str = "file", follow_symlinks: bool = True,
                 max_bytes: int | None = None, **kwargs: Any) -> IO[Any]:
    """`open(path, mode)` for reading, refused (UserError) unless `path` is a regular file of at most
    `max_bytes` bytes at the moment it is opened. Text modes default to UTF-8. `max_bytes` is checked
    against the size when opened; a reader that must not read more than that (a file still growing)
    reads at most max_bytes + 1 bytes, as `read_bytes` does."""
    if any(c in mode for c in "wax+"):
        raise ValueError(f"open_regular reads only, not mode {mode!r}")
    if "b" not in mode:
        kwargs.setdefault("encoding", "utf-8")
    fd = open_fd(path, what=what, follow_symlinks=follow_symlinks, max_bytes=max_bytes)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, *, max_bytes: int, what: str = "file",
               follow_symlinks: bool = True) -> bytes:
    """The whole of the regular file `path`, refused when it holds more than `max_bytes` bytes
    (checked before reading, and again while reading: a file may grow after it was opened)."""
    with open_regular(path, "rb", what=what, follow_symlinks=follow_symlinks, max_bytes=max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UserError(f"{path} grew past the bound of {max_bytes} bytes for {_a(what)} while it was read")
    return data


def read_text(path: str | os.PathLike, *, max_bytes: int, what: str = "file", follow_symlinks: bool = True,
              errors: str = "strict") -> str:
    """`read_bytes` decoded as UTF-8; a file that is not UTF-8 is a UserError naming it (errors="strict")."""
    data = read_bytes(path, max_bytes=max_bytes, what=what, follow_symlinks=follow_symlinks)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: {_a(what)} must be UTF-8 text, and byte {e.start} is not: is it the right "
                        "file?") from None


@contextmanager
def regular_path(path: str | os.PathLike, *, what: str = "file", max_bytes: int | None = None) -> Iterator[str]:
    """For a library that opens a path itself: a path to `path` once it is checked to be a regular
    file. On Linux it is /proc/self/fd/N of the checked open file, so what the library opens is that
    very inode, whatever replaces the name meanwhile; elsewhere it is `path` itself, checked just
    before (a race with whoever can write its folder, documented in docs/security.md)."""
    fd = open_fd(path, what=what, max_bytes=max_bytes)
    try:
        proc = _PROC_FD / str(fd)
        yield str(proc) if proc.exists() else os.fspath(path)
    finally:
        os.close(fd)


def check_regular(path: str | os.PathLike, *, what: str = "file", max_bytes: int | None = None) -> None:
    """Refuse `path` (UserError) unless it is a regular file now: for a library that takes only a
    path and keeps reading it after this call returns (a residual race, see regular_path)."""
    os.close(open_fd(path, what=what, max_bytes=max_bytes))

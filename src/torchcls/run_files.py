"""Files inside a run dir (or an --out dir), which may have come from someone else: never read or written
through a symbolic link.

A run dir is as often one a user was sent as one they made. A link inside it (report.html ->
~/.bashrc, confusion_matrix.png -> ~/.ssh/id_ed25519) turns a write by name into an overwrite of the
link's target, and a read by name into a leak of it (report.html embeds figures). So, by construction:
- a read of a file in a run dir opens it with O_NOFOLLOW (`read_bytes`, `read_text`: io_files with
  follow_symlinks=False): a link is refused, named, as a FIFO or a device is;
- a name that a file of the run dir gives (eval.json's thumbnails, allocator.json's timeline) is taken
  only as a plain relative path below the run dir, with no link on the way (`inside`);
- a write replaces the directory entry instead of writing through it (`replace_file`,
  `write_text_atomic`, `write_bytes_atomic`): a new file is created with O_EXCL | O_NOFOLLOW under a
  random name in the same folder, written, then renamed over the name; a rename replaces a link itself,
  never its target. Readers never see half a file either;
- an append (metrics.jsonl) opens with O_NOFOLLOW | O_APPEND and checks that it got a regular file
  (`append_text`);
- a sub-folder written into (misclassified/, tensorboard/, explain/) is refused when it is a link (`sub_dir`),
  and so is a deeper path (export/aoti-fp32/model.pt2) with a link anywhere below the run dir
  (`refuse_links_below`: export/ -> ~/elsewhere would take model.pt2 and parity.json there). Links above
  the run dir are the user's own and are followed. The run dir is the one the command was given, never
  one recognised by its files: a received one need not hold any.
What stays: someone who can write into the run dir while torchcls runs can still race a name between
a check and a library's own open (docs/security.md); a received run dir is not such a writer.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from torchcls import io_files
from torchcls.errors import UserError
from torchcls.io_errors import writing

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _link(path: Path | str, what: str) -> UserError:
    return UserError(f"{path}: {what} in a run dir is a symbolic link, which torchcls neither follows nor writes "
                     "through (a received run dir could point it at any file of yours): remove the link")


def read_bytes(path: str | os.PathLike, *, max_bytes: int, what: str = "file") -> bytes:
    """The regular file `path` of a run dir (never a link to one), at most `max_bytes` bytes."""
    return io_files.read_bytes(path, max_bytes=max_bytes, what=what, follow_symlinks=False)


def read_text(path: str | os.PathLike, *, max_bytes: int, what: str = "file", errors: str = "strict") -> str:
    return io_files.read_text(path, max_bytes=max_bytes, what=what, follow_symlinks=False, errors=errors)


def is_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file itself (`Path.is_file` says True for a link to one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def inside(run_dir: Path, name: object, what: str = "file") -> Path:
    """`run_dir / name` for a `name` read from a file of the run dir: refused unless it is a relative path
    of plain parts ('..', '.' and empty parts refused) whose folders below `run_dir` are not links."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or PurePosixPath(name).is_absolute() or any(p in ("..", ".") or "\\" in p for p in parts) \
            or "\0" in name:
        raise UserError(f"{run_dir}: {what} {str(name)[:200]!r} is not a path inside the run dir: refused")
    path = run_dir
    for part in parts[:-1]:
        path = path / part
        if os.path.islink(path):
            raise _link(path, "a folder")
    return path / parts[-1]


def refuse_link(path: Path, what: str = "folder") -> Path:
    """`path`, refused (UserError) when it is a symbolic link."""
    if os.path.islink(path):
        raise _link(path, what)
    return path


def refuse_links_below(run_dir: str | os.PathLike, path: str | os.PathLike) -> None:
    """Refuse (UserError) a write to `path` when a folder between `run_dir` and `path` is a symbolic link:
    the write would land wherever the link points. A `path` outside `run_dir` (by name) is not checked."""
    root, here = Path(os.path.abspath(run_dir)), Path(os.path.abspath(path)).parent
    if here != root and root not in here.parents:
        return
    for folder in reversed([here, *here.parents][:len(here.parts) - len(root.parts)]):  # outermost first
        refuse_link(folder, "a folder")


def sub_dir(path: Path, what: str = "folder") -> Path:
    """The folder `path` of a run dir, created if missing; refused when it is a link (writes into it would
    land wherever it points)."""
    refuse_link(path, what)
    path.mkdir(parents=True, exist_ok=True)
    if os.path.islink(path):  # (made a link meanwhile)
        raise _link(path, what)
    return path


def _new_temp(path: Path, mode: int) -> str:
    """A new, empty file beside `path` that this call created (O_EXCL: never an existing name or link). Its
    name ends as `path`'s does: writers that pick a format from the suffix (savefig, PIL) see the same."""
    for _ in range(64):
        tmp = path.parent / f".{path.name[:120]}.{secrets.token_hex(6)}{path.suffix[:16]}"
        try:
            os.close(os.open(tmp, _CREATE, mode))
            return str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def replace_file(path: str | os.PathLike, write: Callable[[str], object], *, durable: bool = False,
                 private: bool = False) -> None:
    """write(tmp) into a new file beside `path`, then rename it over `path`: the name is replaced, never
    written through, and readers see the old file or the new one. `durable`: fsync the file and the folder
    (checkpoints). `private`: mode 0600 (else 0666 less the umask, as open() would make it). A failure
    leaves `path` as it was and is raised as a WriteError naming `path`."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_temp(path, 0o600 if private else 0o666)
        try:
            write(tmp)
            if durable:
                _fsync(tmp, os.O_RDONLY)
            os.replace(tmp, path)
            if durable:
                _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            if e.filename in (tmp, str(tmp)) or e.filename2 == str(path):  # the temp name is ours: name `path`
                raise OSError(e.errno, e.strerror, str(path)) from e
            raise
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _fsync(path: str | os.PathLike, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, **kwargs: bool) -> None:
    replace_file(path, lambda tmp: Path(tmp).write_bytes(data), **kwargs)


def write_text_atomic(path: str | os.PathLike, text: str, **kwargs: bool) -> None:
    replace_file(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), **kwargs)


def append_text(path: str | os.PathLike, text: str, what: str = "file") -> None:
    """Append `text` to the regular file `path` (created if missing), never through a link, never blocking."""
    try:
        fd = os.open(path, _APPEND, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # (what O_NOFOLLOW answers on a link)
            raise _link(path, what) from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise UserError(f"{path}: {what} must be a regular file, and this is a FIFO: refused") from None
        with writing(path):  # (no permission, read-only file system: a WriteError naming the file)
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{path}: {what} must be a regular file, and this is {io_files.kind_of(st.st_mode)}: "
                            "refused")
        data = text.encode("utf-8")
        with writing(path):
            while data:
                data = data[os.write(fd, data):]
    finally:
        os.close(fd)

"""Directories this process made, the only ones it ever removes; anything else is moved aside.

A file inside a directory cannot prove who made the directory: whoever can write there can write
the file too (a hand-written `.created-by.json` once had an elastic restart delete a user's folder).
So the proof is kept where a directory cannot reach it: in this process's memory, as the device and
inode numbers of the directory it created itself (mkdir without exist_ok), and `remove_made` removes
a tree only while its name still leads to that very inode. A directory another process made (an
earlier start of the same job) is at most renamed aside with `move_aside`, never deleted.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MadeDir:
    """A directory this process created, as the inode it created (not only its name)."""

    path: Path
    dev: int
    ino: int

    def still_here(self, path: Path | None = None) -> bool:
        """Whether `path` (default: where it was made) names this very directory now, not a symlink or
        another folder put in its place."""
        try:
            st = os.lstat(path or self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)


def identity(path: Path) -> str:
    """The "device:inode" of `path` itself (a symlink is not followed)."""
    st = os.lstat(path)
    return f"{st.st_dev}:{st.st_ino}"


def make_dir(path: Path) -> MadeDir:
    """Create the directory `path` (its parent must exist); FileExistsError when anything is there."""
    path.mkdir()
    st = os.lstat(path)
    return MadeDir(path, st.st_dev, st.st_ino)


def make_dirs(path: Path) -> MadeDir | None:
    """Create `path` and its missing parents; returns the outermost directory this call created (None
    when `path` already existed). A parent that appears meanwhile (another process) is not ours: then
    only the directories made inside it are."""
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    top = None
    for d in reversed(missing):
        try:
            made = make_dir(d)
        except FileExistsError:
            top = None  # someone else's: what we make inside it is ours, it is not
            continue
        top = top or made
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    return top


def remove_made(made: MadeDir) -> bool:
    """Remove the tree this process made, if its name still leads to it. The tree is first renamed to a
    fresh hidden name and checked again there, so what is removed is what was checked, whatever an
    other process renames meanwhile. Returns whether it is gone."""
    if not made.still_here():
        return False
    doomed = made.path.with_name(f".{made.path.name}.removing-{secrets.token_hex(6)}")
    try:
        os.rename(made.path, doomed)
    except OSError:
        return False
    if not made.still_here(doomed):  # replaced between the check and the rename: not ours, put it back
        try:
            os.rename(doomed, made.path)
        except OSError:
            pass
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return not os.path.lexists(doomed)


def aside_name(path: Path, why: str) -> Path:
    """A sibling name no one has: `<name>.<why>-<UTC time>-<random>`."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return path.with_name(f"{path.name}.{why}-{stamp}-{secrets.token_hex(3)}")


def move_aside(path: Path, why: str) -> Path:
    """Rename `path` (a directory this process did not make) to a fresh sibling name, keeping every file
    in it; returns the new name. OSError when it cannot be renamed (a mount point, no permission)."""
    target = aside_name(path, why)
    os.rename(path, target)  # the random part makes an existing target (which rename could replace) moot
    return target

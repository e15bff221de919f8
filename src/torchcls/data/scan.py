"""List image files and read their headers (format and size) in parallel, never their pixels.

Opening a folder used to decode every file (~3.5 ms each: 74 minutes for ImageNet on 2
cores); a header costs ~0.05 ms. A file that passes the scan but fails to decode later is
handled by the loader (see `skips.py`). Nothing found while listing is dropped silently:
broken symlinks, unreadable entries and directories named like images come back with a reason.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from torchcls.data.images import BadImage, read_header

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm"}


@dataclass
class Listing:
    files: list[Path] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (entry, reason)


def list_files(root: Path) -> Listing:
    """Every regular file under `root` (hidden names excepted), in sorted order, symlinks followed once."""
    out = Listing()
    seen: set[tuple[int, int]] = set()
    _walk(root, out, seen)
    return out


def _walk(folder: Path, out: Listing, seen: set[tuple[int, int]]) -> None:
    try:
        st = folder.stat()
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop, or the same folder linked twice
            out.problems.append((str(folder), "folder already listed through another link (not read twice)"))
            return
        seen.add((st.st_dev, st.st_ino))
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except PermissionError:
        out.problems.append((str(folder), "permission denied: folder not readable"))
        return
    except OSError as e:
        out.problems.append((str(folder), f"folder not readable: {e.strerror or e}"))
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        path = Path(entry.path)
        try:
            is_dir, is_file = entry.is_dir(), entry.is_file()
        except OSError as e:
            out.problems.append((str(path), f"not readable: {e.strerror or e}"))
            continue
        if is_dir:
            if path.suffix.lower() in IMAGE_SUFFIXES:
                out.problems.append((str(path), "a directory named like an image file (its contents are read)"))
            _walk(path, out, seen)
        elif is_file:
            out.files.append(path)
        elif entry.is_symlink():
            out.problems.append((str(path), f"broken symlink (points to {os.readlink(path)}, which does not exist)"))
        else:
            out.problems.append((str(path), "not a regular file (device, socket or pipe)"))


def _header(path: Path) -> tuple[str, int, int] | str:
    try:
        return read_header(path)
    except BadImage as e:
        return str(e)


def scan_headers(paths: list[Path], threads: int | None = None) -> list[tuple[str, int, int] | str]:
    """For each path: (format, width, height), or the reason it cannot be read as an image."""
    if len(paths) < 64:
        return [_header(p) for p in paths]
    # Headers are small reads: threads overlap the file-system latency (cold caches, network disks).
    # Parsing them holds the GIL, so more threads than ~2 per core only add contention.
    workers = threads or min(8, (os.cpu_count() or 1) * 2)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_header, paths, chunksize=256))

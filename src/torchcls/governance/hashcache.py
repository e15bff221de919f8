"""File hashes that survive between runs, so unchanged data files are not read again at each run start.

A cache entry maps (resolved path, size, mtime_ns, inode) to the file's SHA-256. Writing a file
changes its mtime (and replacing it changes its inode), so a changed file misses the cache and is
re-read. A file modified within the file system's timestamp resolution of being hashed could keep
its old mtime: entries for files modified less than `FRESH_NS` before hashing are not stored (git's
"racily clean" rule). Someone who restores a file's mtime on purpose defeats any such cache, which
is why `torchcls verify` re-reads every file unless told otherwise.

The cache is a small SQLite file (OUT_DIR/_governance/hash_cache.sqlite): ranks and parallel runs
may write it at the same time.
"""

from __future__ import annotations

import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from torchcls.provenance.digest import sha256_file

CACHE_FILE = "hash_cache.sqlite"
FRESH_NS = 2_000_000_000

Key = tuple[str, int, int, int]


class HashCache:
    """`hash_files` returns (sha256, size) per file; `hits` and `misses` count files served from the
    cache and files read. `HashCache(None)` reads every file (verify's default)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self.hits = 0
        self.misses = 0
        self._known: dict[str, tuple[int, int, int, str]] | None = None  # the table, read once

    def hash_files(self, paths: list[Path]) -> list[tuple[str, int]]:
        stats = [p.stat() for p in paths]
        keys: list[Key] = [(str(p.resolve()), s.st_size, s.st_mtime_ns, s.st_ino) for p, s in zip(paths, stats)]
        known = self._load()
        todo = [i for i, k in enumerate(keys) if known.get(k[0], (None,))[:3] != k[1:]]
        fresh = dict(zip(todo, _hash_parallel([paths[i] for i in todo])))
        self.hits += len(paths) - len(todo)
        self.misses += len(todo)
        now = time.time_ns()
        rows = [(*keys[i], digest) for i, digest in fresh.items() if now - keys[i][2] > FRESH_NS]
        if self.path is not None and rows:
            self._store(rows)
            known.update((path, (size, mtime, ino, digest)) for path, size, mtime, ino, digest in rows)
        return [(fresh[i] if i in fresh else known[k[0]][3], k[1]) for i, k in enumerate(keys)]

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses}

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path, timeout=60)
        con.execute("CREATE TABLE IF NOT EXISTS hashes (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                    "inode INTEGER, sha256 TEXT)")
        return con

    def _load(self) -> dict[str, tuple[int, int, int, str]]:
        if self._known is None:
            self._known = self._read()
        return self._known

    def _read(self) -> dict[str, tuple[int, int, int, str]]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            with closing(self._connect()) as con:
                return {p: (size, mtime, ino, digest)
                        for p, size, mtime, ino, digest in con.execute("SELECT * FROM hashes")}
        except sqlite3.DatabaseError:  # a damaged cache only costs time: hash everything, rebuild it
            self.path.unlink(missing_ok=True)
            return {}

    def _store(self, rows: list[tuple[str, int, int, int, str]]) -> None:
        try:
            with closing(self._connect()) as con, con:
                con.executemany("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?)", rows)
        except sqlite3.OperationalError:  # read-only or locked for too long: the run goes on uncached
            pass


def _hash_parallel(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL on large buffers: threads overlap hashing and disk reads.
    if len(paths) < 2:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        return list(pool.map(sha256_file, paths))

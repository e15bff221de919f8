"""File hashes that survive between runs, so unchanged data files are not read again at each run start.

A cache entry maps (resolved path, size, mtime_ns, inode) to the file's SHA-256. Writing a file
changes its mtime (and replacing it changes its inode), so a changed file misses the cache and is
re-read. A file modified within the file system's timestamp resolution of being hashed could keep
its old mtime: entries for files modified less than `FRESH_NS` before hashing are not stored (git's
"racily clean" rule). Someone who restores a file's mtime on purpose defeats any such cache, which
is why `torchcls verify` re-reads every file unless told otherwise.

The cache is a small SQLite file (OUT_DIR/_governance/hash_cache.sqlite): ranks and parallel runs
may write it at the same time. Only a store of the user's own is ever opened (a run's OUT_DIR, or the
one `verify --no-rehash --out-dir` names), and even that is read as untrusted, through SQLite's
read-only URI mode: its one table must be exactly the table below (no view, whose query could run
without end, no trigger, no other column), and only the rows of the files asked about are read,
each typed. `read_only` never writes, creates or deletes the file.
"""

from __future__ import annotations

import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from torchcls.errors import UserError
from torchcls.provenance.digest import sha256_file
from torchcls.typed_json import check, sha256_type

CACHE_FILE = "hash_cache.sqlite"
FRESH_NS = 2_000_000_000
TABLE = "CREATE TABLE hashes (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, inode INTEGER, sha256 TEXT)"
# sqlite_master of a cache this module wrote: the table and its primary key's index, nothing else
SCHEMA = {("table", "hashes", TABLE), ("index", "sqlite_autoindex_hashes_1", None)}
LOOKUP_CHUNK = 500  # paths per query (under SQLite's 999 bound variables); path is the key: <= 500 rows each

Key = tuple[str, int, int, int]


class HashCache:
    """`hash_files` returns (sha256, size) per file; `hits` and `misses` count files served from the
    cache and files read. `HashCache(None)` reads every file (verify's default); `read_only`: the cache
    is consulted, never written, created or deleted."""

    def __init__(self, path: str | Path | None, read_only: bool = False):
        self.path = Path(path) if path is not None else None
        self.read_only = read_only
        self.hits = 0
        self.misses = 0
        self._known: dict[str, tuple[int, int, int, str]] = {}  # rows looked up so far

    def hash_files(self, paths: list[Path]) -> list[tuple[str, int]]:
        stats = [p.stat() for p in paths]
        keys: list[Key] = [(str(p.resolve()), s.st_size, s.st_mtime_ns, s.st_ino) for p, s in zip(paths, stats)]
        known = self._load([k[0] for k in keys])
        todo = [i for i, k in enumerate(keys) if known.get(k[0], (None,))[:3] != k[1:]]
        fresh = dict(zip(todo, _hash_parallel([paths[i] for i in todo])))
        self.hits += len(paths) - len(todo)
        self.misses += len(todo)
        now = time.time_ns()
        rows = [(*keys[i], digest) for i, digest in fresh.items() if now - keys[i][2] > FRESH_NS]
        if self.path is not None and rows and not self.read_only:
            self._store(rows)
            known.update((path, (size, mtime, ino, digest)) for path, size, mtime, ino, digest in rows)
        return [(fresh[i] if i in fresh else known[k[0]][3], k[1]) for i, k in enumerate(keys)]

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses}

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path, timeout=60)
        con.execute(TABLE.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS"))
        return con

    def _load(self, paths: list[str]) -> dict[str, tuple[int, int, int, str]]:
        wanted = [p for p in dict.fromkeys(paths) if p not in self._known]
        if wanted and self.path is not None and self.path.is_file():
            self._known.update(self._read(wanted))
        return self._known

    def _read(self, paths: list[str]) -> dict[str, tuple[int, int, int, str]]:
        try:
            with closing(self._open()) as con:
                _check_schema(con, self.path)
                return {p: (size, mtime, ino, digest) for chunk in _chunks(paths)
                        for p, size, mtime, ino, digest in _rows(con, chunk, self.path)}
        except (sqlite3.Error, UserError):  # not a cache this module wrote: it only costs time, hash everything
            if not self.read_only:  # a store of the user's own runs: rebuilt (a read-only reader leaves it as is)
                self.path.unlink(missing_ok=True)
            return {}

    def _open(self) -> sqlite3.Connection:
        """Reads never write: SQLite's read-only URI mode (no table is created, no journal rolled back here)."""
        con = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=60)
        con.execute("PRAGMA trusted_schema=OFF")  # no function of the file's schema runs on a read
        return con

    def _store(self, rows: list[tuple[str, int, int, int, str]]) -> None:
        try:
            with closing(self._connect()) as con, con:
                con.executemany("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?)", rows)
        except sqlite3.OperationalError:  # read-only or locked for too long: the run goes on uncached
            pass


def _check_schema(con: sqlite3.Connection, path: Path) -> None:
    found = set(con.execute("SELECT type, name, sql FROM sqlite_master LIMIT 8"))
    if found != SCHEMA:
        raise UserError(f"{path}: its tables are not the hash cache's ({sorted(n for _, n, _ in found)})")


def _rows(con: sqlite3.Connection, paths: list[str], where: Path) -> list[tuple[str, int, int, int, str]]:
    """The rows of `paths` (at most one each: path is the key), typed."""
    rows = con.execute(f"SELECT path, size, mtime_ns, inode, sha256 FROM hashes WHERE path IN "
                       f"({', '.join('?' * len(paths))}) LIMIT ?", (*paths, len(paths))).fetchall()
    return check(rows, list[tuple[str, int, int, int, sha256_type()]], str(where))


def _chunks(items: list[str]) -> list[list[str]]:
    return [items[i:i + LOOKUP_CHUNK] for i in range(0, len(items), LOOKUP_CHUNK)]


def _hash_parallel(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL on large buffers: threads overlap hashing and disk reads.
    if len(paths) < 2:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        return list(pool.map(sha256_file, paths))

"""Does the data on disk still match its manifest? Re-hash and compare, naming every difference.

"The data" is what torchcls.data lists (data_files): at training time the files the run will read,
resolved with the run's own --root, so a manifest cannot vouch for files other than the trained ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.hashcache import HashCache
from torchcls.governance.manifest import BUILTIN_META, source_id

WALK_FACTOR, WALK_SLACK = 2, 1000  # entries a data folder may hold per record, and beyond them


def record_path(manifest: dict[str, Any], record: dict[str, Any]) -> Path:
    url = Path(record["contentUrl"])
    return url if url.is_absolute() else Path(manifest["tc:root"]) / url


def check_data(manifest: dict[str, Any], files: list[Path] | None = None,
               cache: HashCache | None = None) -> list[str]:
    """Problems found (empty = the files are exactly the ones hashed); each names the file.

    `files`: the files a run reads (data_files with the run's --root); default: the manifest's own
    source listed from its root. `cache` spares re-reading files unchanged since they were hashed."""
    cache = cache or HashCache(None)
    problems = _check_packed(manifest, cache)
    if manifest["tc:source"] in BUILTIN_META:
        return problems
    present = []
    for r in manifest["tc:records"]:
        p = record_path(manifest, r)
        if not p.is_file():
            problems.append(f"{p}: missing (listed in the manifest)")
        elif p.stat().st_size != r["contentSize"]:
            problems.append(f"{p}: content changed (its size differs from the manifest)")
        else:
            present.append((p, r))
    for (p, r), (digest, _) in zip(present, cache.hash_files([p for p, _ in present])):
        if digest != r["sha256"]:
            problems.append(f"{p}: content changed (SHA-256 differs from the manifest)")
    try:  # (verify lists the folder a possibly received manifest names: what fails there is a problem found)
        unlisted = _unlisted(manifest, files)
    except UserError as e:
        return [*problems, f"{manifest['tc:source']}: its files could not be listed against the manifest: {e}"]
    problems += [f"{p}: not in the manifest (added after it was written, or read from another --root "
                 "than the manifest's)" for p in unlisted]
    return problems


def _check_packed(manifest: dict[str, Any], cache: HashCache) -> list[str]:
    """The distribution's files with a hash: a built-in set's packed files, a CSV's own file."""
    problems, present = [], []
    for d in manifest.get("distribution", []):
        if "sha256" not in d:
            continue
        p = Path(manifest["tc:root"]) / d["contentUrl"]
        if not p.is_file():
            problems.append(f"{p}: missing (listed in the manifest)")
        else:
            present.append((p, d))
    for (p, d), (digest, _) in zip(present, cache.hash_files([p for p, _ in present])):
        if digest != d["sha256"]:
            problems.append(f"{p}: content changed (SHA-256 differs from the manifest)")
    return problems


def _unlisted(manifest: dict[str, Any], files: list[Path] | None) -> list[Path]:
    """Files the data source reads that the manifest does not list."""
    src = Path(manifest["tc:source"])
    if files is None:
        if not src.exists():
            return []
        _check_size(src, len(manifest["tc:records"]))
        from torchcls.data.dataset_files import data_files

        files = data_files(str(src), manifest["tc:root"])
    listed = {record_path(manifest, r).resolve() for r in manifest["tc:records"]}
    listed |= {src.resolve()}  # a CSV is checked as a distribution file, not a record
    return [p for p in files if p.resolve() not in listed]


def _check_size(src: Path, records: int) -> None:
    """Refuse to list a folder far larger than the manifest's data: the manifest names the folder (`tc:source`),
    and one that came with a received artifact could name /usr. Its record count is the size to expect; past
    it (with room for folders and files the loader skips), the walk stops."""
    if not src.is_dir():
        return
    limit, seen = WALK_FACTOR * records + WALK_SLACK, 0
    for _, dirs, names in os.walk(src):  # (symlinks are not followed)
        seen += len(dirs) + len(names)
        if seen > limit:
            raise UserError(f"{src} holds more than {limit} files and folders, for a manifest of {records} records: "
                            "not listed (the manifest names another folder than its data, or files were added)")


def describes(manifest: dict[str, Any], source: str) -> bool:
    return manifest["tc:source"] == source_id(source)

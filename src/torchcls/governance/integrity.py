"""Does the data on disk still match its manifest? Re-hash and compare, naming every difference.

"The data" is what torchcls.data lists (data_files): at training time the files the run will read,
resolved with the run's own --root, so a manifest cannot vouch for files other than the trained ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.governance.hashcache import HashCache
from torchcls.governance.manifest import BUILTIN_META, source_id


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
    problems += [f"{p}: not in the manifest (added after it was written, or read from another --root "
                 "than the manifest's)" for p in _unlisted(manifest, files)]
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
        from torchcls.data.dataset_files import data_files

        files = data_files(str(src), manifest["tc:root"])
    listed = {record_path(manifest, r).resolve() for r in manifest["tc:records"]}
    listed |= {src.resolve()}  # a CSV is checked as a distribution file, not a record
    return [p for p in files if p.resolve() not in listed]


def describes(manifest: dict[str, Any], source: str) -> bool:
    return manifest["tc:source"] == source_id(source)

"""Does the data on disk still match its manifest? Re-hash and compare, naming every difference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.governance.digest import sha256_file
from torchcls.governance.manifest import BUILTIN_META, csv_rows, folder_files, source_id


def record_path(manifest: dict[str, Any], record: dict[str, Any]) -> Path:
    url = Path(record["contentUrl"])
    return url if url.is_absolute() else Path(manifest["tc:root"]) / url


def check_data(manifest: dict[str, Any]) -> list[str]:
    """Problems found (empty = the files are exactly the ones hashed); each names the file."""
    if manifest["tc:source"] in BUILTIN_META:
        return _check_packed(manifest)
    problems = []
    for r in manifest["tc:records"]:
        p = record_path(manifest, r)
        if not p.is_file():
            problems.append(f"{p}: missing (listed in the manifest)")
        elif p.stat().st_size != r["contentSize"] or sha256_file(p) != r["sha256"]:
            problems.append(f"{p}: content changed (SHA-256 differs from the manifest)")
    problems += [f"{p}: not in the manifest (added after it was written)" for p in _unlisted(manifest)]
    return problems


def _check_packed(manifest: dict[str, Any]) -> list[str]:
    problems = []
    for d in manifest["distribution"]:
        p = Path(manifest["tc:root"]) / d["contentUrl"]
        if not p.is_file():
            problems.append(f"{p}: missing (listed in the manifest)")
        elif sha256_file(p) != d["sha256"]:
            problems.append(f"{p}: content changed (SHA-256 differs from the manifest)")
    return problems


def _unlisted(manifest: dict[str, Any]) -> list[Path]:
    """Files the data source would now read that the manifest does not list."""
    src = Path(manifest["tc:source"])
    listed = {record_path(manifest, r).resolve() for r in manifest["tc:records"]}
    if src.is_dir():
        current = [f.resolve() for f, _ in folder_files(src)]
    elif src.is_file():
        current = [p for p, _, _ in csv_rows(src, Path(manifest["tc:root"]))]
    else:
        return []
    return [p for p in current if p not in listed]


def describes(manifest: dict[str, Any], source: str) -> bool:
    return manifest["tc:source"] == source_id(source)

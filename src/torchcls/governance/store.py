"""The manifest store beside the audit log: manifests kept by their hash (dateCreated included),
so that records stay small and `verify` finds the exact manifest a run recorded."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.manifest import (
    MAX_MANIFEST_BYTES,
    content_key,
    manifest_hash,
    parse_manifest_json,
    save_manifest,
)
from torchcls.io_files import read_bytes, read_text


def store_given(m: dict[str, Any], store: Path) -> None:
    """A manifest the user passed (--data-manifest): kept as it is."""
    target = store / f"{manifest_hash(m)}.json"
    if not target.is_file():
        save_manifest(m, target)


def store_built(m: dict[str, Any], store: Path) -> dict[str, Any]:
    """A manifest built at the start of a run; returns the one to use. A manifest of the same content
    (same data, same metadata) stored before is reused, so its first dateCreated stands and the store
    does not grow by one manifest per run. by-content/<content key> names it."""
    index = store / "by-content" / content_key(m)
    name = read_text(index, max_bytes=256, what="manifest store index").strip() if index.exists() else None
    earlier = store / f"{name}.json" if name else None
    if earlier is not None and earlier.exists():
        data = read_bytes(earlier, max_bytes=MAX_MANIFEST_BYTES, what="stored manifest")
        try:
            old = parse_manifest_json(data, str(earlier))
        except UserError:  # not JSON, or past MANIFEST_BOUNDS: stored again below
            old = None
        if isinstance(old, dict) and content_key(old) == content_key(m) and manifest_hash(old) == earlier.stem:
            return old
    store_given(m, store)
    index.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=index.parent, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(manifest_hash(m))
    os.replace(tmp, index)
    return m

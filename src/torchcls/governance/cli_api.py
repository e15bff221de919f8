"""Library side of `torchcls data manifest`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.governance.manifest import BUILTIN_META, DatasetMeta, build_manifest, save_manifest


def write_manifest(data: str, out: str | Path | None = None, root: str | None = None,
                   meta: DatasetMeta | None = None) -> tuple[Path, dict[str, Any]]:
    """Hash `data` into a manifest file; built-in sets start from their known metadata, and any field
    given in `meta` overrides it. Returns (path written, manifest)."""
    base = BUILTIN_META.get(data, DatasetMeta())
    if meta is not None:
        base = DatasetMeta(**{k: (v if v not in (None, []) else getattr(base, k)) for k, v in meta.__dict__.items()})
    manifest = build_manifest(data, root, base)
    out = Path(out) if out else Path(f"{Path(data).stem if data not in BUILTIN_META else data}.manifest.json")
    return save_manifest(manifest, out), manifest

"""Artifacts carry their lineage id; exporters register what they produce.

Checkpoints (safetensors) get the id in their metadata under `torchcls.lineage`, written when they
are saved (`Governance.checkpoint_metadata()`). Any other file
(an AOTInductor package, a .pte, an .onnx) gets a sidecar `<file>.lineage.json`. Either way the
audit log holds the artifact's SHA-256, so a changed byte is caught by `torchcls verify`.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.digest import sha256_file
from torchcls.governance.lineage import AuditLog

LINEAGE_KEY = "torchcls.lineage"


def stamp_checkpoint(path: Path, lineage: dict[str, Any]) -> None:
    """Rewrite a safetensors file with `lineage` added to its metadata (atomic; tensors unchanged).
    Only for checkpoints saved without it; a trainer stamps its checkpoints at save time."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from torchcls.checkpoint.files import atomic_write

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
    tensors = load_file(str(path))
    metadata[LINEAGE_KEY] = json.dumps(lineage, sort_keys=True)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".lineage.json")


def read_lineage(path: str | Path) -> dict[str, Any] | None:
    """The lineage an artifact carries (metadata or sidecar), or None when it carries none or is unreadable."""
    path = Path(path)
    side = sidecar(path)
    if side.is_file():
        try:
            return json.loads(side.read_text())
        except json.JSONDecodeError:
            return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(LINEAGE_KEY)
        return json.loads(raw) if raw else None
    except Exception:  # not safetensors, or its header was damaged: the hash check will say which
        return None


def register_artifact(path: str | Path, source_checkpoint: str | Path, kind: str = "export",
                      details: dict[str, Any] | None = None) -> str:
    """For exporters: record `path` (built from `source_checkpoint`) in the audit log; returns its lineage id.

    The source checkpoint must carry a lineage id (runs stamp theirs); the new artifact gets a
    sidecar naming its own id and its parent, and the log gets both hashes.
    """
    path, source_checkpoint = Path(path), Path(source_checkpoint)
    if not path.is_file():
        raise UserError(f"register_artifact: {path} does not exist")
    parent = read_lineage(source_checkpoint)
    if parent is None:
        raise UserError(f"{source_checkpoint} carries no lineage id: it was not produced by a run with lineage on")
    artifact_id = uuid.uuid4().hex
    log = AuditLog(parent["audit_log"])
    log.append("artifact", {"artifact_id": artifact_id, "parent_run_id": parent["run_id"],
                            "parent_sha256": sha256_file(source_checkpoint), "path": str(path.resolve()),
                            "sha256": sha256_file(path), "artifact_kind": kind, "details": details or {}})
    lineage = {"run_id": parent["run_id"], "artifact_id": artifact_id, "audit_log": parent["audit_log"],
               "outputs": parent.get("outputs", {})}
    sidecar(path).write_text(json.dumps(lineage, indent=2, sort_keys=True))
    return artifact_id


def outputs_allowed(artifact: str | Path) -> dict[str, bool]:
    """What the policy of the run that built `artifact` lets leave it (sample_images, embeddings,
    predictions); all True for artifacts built without a policy. For serve/export code to consult."""
    lineage = read_lineage(artifact) or {}
    return {"sample_images": True, "embeddings": True, "predictions": True, **lineage.get("outputs", {})}

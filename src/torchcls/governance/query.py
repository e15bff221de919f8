"""`torchcls lineage --file`: which runs and artifacts were built from a file (erasure requests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.integrity import record_path
from torchcls.governance.manifest import MAX_MANIFEST_BYTES, parse_manifest_json
from torchcls.io_files import read_bytes
from torchcls.provenance.digest import looks_like_sha256, sha256_file
from torchcls.provenance.lineage import AuditLog, manifest_store


def file_lineage(path_or_hash: str, audit_log: str | Path) -> dict[str, Any]:
    """Manifests holding the file (by content hash, or by path), the runs that used them, and every
    artifact built by those runs or derived from their artifacts."""
    p = Path(path_or_hash)
    if p.is_file():
        digest, resolved = sha256_file(p), str(p.resolve())
    elif looks_like_sha256(path_or_hash):
        digest, resolved = path_or_hash.removeprefix("sha256:").lower(), None
    else:
        raise UserError(f"--file {path_or_hash!r} is neither an existing file nor a SHA-256 hex digest")
    log = AuditLog(audit_log)
    broken = [str(x) for x in log.check_chain()]
    manifests = _manifests_with(manifest_store(log.path), digest, resolved)
    runs, artifacts, run_ids = [], [], set()
    for _, rec, _ in log.records():
        if not rec:
            continue
        if rec.get("kind") == "run" and any(m.get("manifest_sha256") in manifests for m in rec.get("manifests", [])):
            run_id = rec.get("run_id")  # (optional in RunRecord: a record without one is listed, run_id null,
            if run_id is not None:  # but never an id that artifacts recording no parent would match: None == None)
                run_ids.add(run_id)
            runs.append({"run_id": run_id, "run_dir": rec.get("run_dir"), "time": rec.get("time"), "seq": rec["seq"]})
            artifacts += [{**a, "run_id": run_id} for a in rec.get("artifacts", [])]
        elif rec.get("kind") == "artifact" and rec.get("parent_run_id") in run_ids:
            artifacts.append({"path": rec["path"], "sha256": rec["sha256"], "artifact_kind": rec.get("artifact_kind"),
                              "run_id": rec["parent_run_id"], "artifact_id": rec.get("artifact_id")})
    return {"file": path_or_hash, "sha256": digest, "manifests": manifests, "runs": runs,
            "artifacts": _latest(artifacts), "audit_log": str(log.path), "audit_log_problems": broken}


def _manifests_with(store: Path, digest: str, resolved: str | None) -> dict[str, list[str]]:
    """{manifest hash: [record ids that are this file]}"""
    hits: dict[str, list[str]] = {}
    for f in sorted(store.glob("*.json")) if store.is_dir() else []:
        data = read_bytes(f, max_bytes=MAX_MANIFEST_BYTES, what="stored manifest")  # (not a regular file: said)
        try:
            m = parse_manifest_json(data, str(f))
        except UserError:  # not JSON, or past MANIFEST_BOUNDS: not a manifest torchcls stored
            continue
        ids = [r["@id"] for r in m.get("tc:records", []) if r.get("sha256") == digest
               or (resolved is not None and "contentUrl" in r and str(record_path(m, r).resolve()) == resolved)]
        if ids:
            hits[f.stem] = ids
    return hits


def _latest(artifacts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per artifact path: the newest record wins (a resumed run re-records its checkpoints)."""
    by_path = {}
    for a in artifacts:
        by_path[a["path"]] = a
    return list(by_path.values())

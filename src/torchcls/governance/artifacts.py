"""Artifacts carry their lineage id; exporters register what they produce.

Checkpoints (safetensors) get the id in their metadata under `torchcls.lineage`, written when they
are saved (`Governance.checkpoint_metadata()`). Any other file
(an AOTInductor package, a .pte, an .onnx) gets a sidecar `<file>.lineage.json`. Either way the
audit log holds the artifact's SHA-256, so a changed byte is caught by `torchcls verify`.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.digest import looks_like_sha256, sha256_file
from torchcls.governance.keys import load_key
from torchcls.governance.lineage import AuditLog, record_hash
from torchcls.governance.signing import signer_from
from torchcls.io_files import read_bytes, regular_path
from torchcls.run_files import write_text_atomic

LINEAGE_KEY = "torchcls.lineage"
SIDECAR_BYTES = 1 << 20  # a sidecar is a JSON object of a few hundred bytes


def stamp_checkpoint(path: Path, lineage: dict[str, Any]) -> None:
    """Rewrite a safetensors file with `lineage` added to its metadata (atomic; tensors unchanged).
    Only for checkpoints saved without it; a trainer stamps its checkpoints at save time."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from torchcls.checkpoint.files import atomic_write

    with regular_path(path, what="checkpoint") as checked:
        with safe_open(checked, framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(checked)
    metadata[LINEAGE_KEY] = json.dumps(lineage, sort_keys=True)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".lineage.json")


def read_sidecar(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`'s sidecar; None when there is none or it is not JSON. A sidecar that is
    not a regular file (a FIFO would block the read) or is larger than any sidecar is a UserError."""
    side = sidecar(path)
    if not os.path.lexists(side):
        return None
    try:
        found = json.loads(read_bytes(side, max_bytes=SIDECAR_BYTES, what="lineage sidecar"))
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return None
    return found if isinstance(found, dict) else None


def read_lineage(path: str | Path) -> dict[str, Any] | None:
    """The lineage an artifact carries (metadata or sidecar), or None when it carries none or is unreadable.
    The artifact and its sidecar are opened only as regular files (UserError otherwise): `predict` and
    `serve` call this first, before the loader, so a FIFO named `model.pt2` must not block here."""
    path = Path(path)
    if os.path.lexists(sidecar(path)):
        return read_sidecar(path)
    try:
        from safetensors import safe_open

        with regular_path(path, what="artifact") as checked, safe_open(checked, framework="pt") as f:
            raw = (f.metadata() or {}).get(LINEAGE_KEY)
        return json.loads(raw) if raw else None
    except UserError:  # not a regular file: said before anything else reads it
        raise
    except Exception:  # not safetensors, or its header was damaged: the hash check will say which
        return None


def register_artifact(path: str | Path, source_checkpoint: str | Path, kind: str = "export",
                      details: dict[str, Any] | None = None, key_file: str | None = None,
                      sha256: str | None = None, signing_key_file: str | None = None) -> str:
    """For exporters: record `path` (built from `source_checkpoint`) in the audit log; returns its lineage id.

    The source checkpoint must carry a lineage id (runs stamp theirs); the new artifact gets a
    sidecar naming its own id, its parent and the hash of its audit record (the log's head, pinned),
    and the log gets both files' hashes. With a signing key (`signing_key_file`, else
    $TORCHCLS_SIGNING_KEY) the record is signed with it and a signed in-toto attestation is written
    beside the artifact (attestation.py); else with the legacy audit key when one is set (keys.load_key).
    `sha256`: the artifact's digest as its builder took it (else it is hashed here, where it lies now).
    """
    path, source_checkpoint = Path(path), Path(source_checkpoint)
    if not path.is_file():
        raise UserError(f"register_artifact: {path} does not exist")
    parent = read_lineage(source_checkpoint)
    if parent is None:
        raise UserError(f"{source_checkpoint} carries no lineage id: it was not produced by a run with lineage on")
    artifact_id = uuid.uuid4().hex
    log_path = Path(parent["audit_log"])
    signer = signer_from(signing_key_file, near=[log_path.parent])
    log = AuditLog(log_path, load_key(key_file, near=[log_path.parent]), signer)
    digest, parent_sha256 = sha256 or sha256_file(path), sha256_file(source_checkpoint)
    record = log.append("artifact", {"artifact_id": artifact_id, "parent_run_id": parent["run_id"],
                                     "parent_sha256": parent_sha256, "path": str(path.resolve()),
                                     "sha256": digest, "artifact_kind": kind, "details": details or {}})
    if signer is not None:
        from torchcls.governance.attestation import statement, write_attestation

        write_attestation(path, statement(path, digest, source_checkpoint, parent_sha256, _run_manifests(log, parent),
                                          kind, details or {}, artifact_id), signer)
    lineage = {"run_id": parent["run_id"], "artifact_id": artifact_id, "audit_log": parent["audit_log"],
               "outputs": parent.get("outputs", {}), "chain_head": {"seq": record["seq"], "hash": record["hash"]},
               **{k: parent[k] for k in ("policy", "key_id", "signer") if k in parent},
               **({"signer": signer.keyid} if signer is not None else {})}
    write_text_atomic(sidecar(path), json.dumps(lineage, indent=2, sort_keys=True))
    return artifact_id


def _run_manifests(log: AuditLog, parent: dict[str, Any]) -> list[dict[str, Any]]:
    """The data manifests the source checkpoint's run recorded (none while that run has not finished)."""
    runs = [r for _, r, _ in log.records() if r and r["kind"] == "run" and r.get("run_id") == parent["run_id"]]
    found = runs[-1].get("manifests") if runs else None
    return [m for m in found or [] if isinstance(m, dict) and isinstance(m.get("manifest_sha256"), str)]


def register_export(path: Path, checkpoint: Path, details: dict[str, Any], sha256: str | None = None) -> str | None:
    """`torchcls export`: register the published artifact (`sha256`: its digest taken right after the
    build) when its checkpoint carries a lineage id."""
    parent = read_lineage(checkpoint)
    if parent is None or not Path(parent.get("audit_log", "")).is_file():
        return None
    try:
        return register_artifact(path, checkpoint, kind=f"export-{details.get('target', '')}", details=details,
                                 sha256=sha256)
    except UserError as e:
        raise UserError(f"{path} was exported but not registered in the audit log: {e}") from None


def refuse_forbidden_predictions(artifact: str | Path, command: str) -> None:
    """`predict` and `serve`: refuse an artifact whose run's policy sets [outputs] predictions = false."""
    path = Path(artifact)
    if path.is_dir():
        from torchcls.checkpoint.files import resolve_checkpoint

        path = resolve_checkpoint(path)
    lineage = read_lineage(path) or {}
    if outputs_allowed(path)["predictions"]:
        return
    policy = lineage.get("policy")
    named = f"policy '{policy['name']}' ({policy['file']})" if policy else "its policy"
    raise UserError(f"torchcls {command} refused: {artifact} was built by run {lineage.get('run_id')} under {named}, "
                    "which sets [outputs] predictions = false: this model's predictions may not leave the run")


def check_pinned_sha256(path: str | Path, expected: str | None) -> None:
    """Before loading (a .pt2 is native code: it runs when loaded): the file's SHA-256 must be `expected`,
    or, when none is given, the digest governance registered for it (its sidecar's audit record)."""
    path = Path(path)
    if path.is_dir():
        from torchcls.checkpoint.files import resolve_checkpoint

        path = resolve_checkpoint(path)
    if expected is not None:
        if not looks_like_sha256(expected):
            raise UserError(f"--expect-sha256 {expected!r}: not a SHA-256 hex digest (64 hex digits)")
        want, where = expected.removeprefix("sha256:").lower(), "the expected (--expect-sha256)"
    else:
        registered = registered_sha256(path)
        if registered is None:
            return
        want, where = registered
    got = sha256_file(path)
    if got != want:
        raise UserError(f"{path}: its SHA-256 {got[:16]}… differs from {where} {want[:16]}…: refusing to load it "
                        "(the file changed; a .pt2 would run its native code when loaded)")


def registered_sha256(path: Path) -> tuple[str, str] | None:
    """(digest, where) registered for an exported artifact by `register_artifact`, or None."""
    lineage = read_sidecar(path) or {}
    log = Path(str(lineage.get("audit_log", "")))
    if not lineage.get("artifact_id") or not log.is_file():
        return None
    for _, rec, _ in AuditLog(log).records():
        if rec and rec.get("kind") == "artifact" and rec.get("artifact_id") == lineage["artifact_id"] \
                and rec.get("hash") == record_hash(rec):
            return rec["sha256"], f"the digest registered in {log} (seq {rec['seq']})"
    return None


def outputs_allowed(artifact: str | Path) -> dict[str, bool]:
    """What the policy of the run that built `artifact` lets leave it (sample_images, embeddings,
    predictions); all True for artifacts built without a policy. For serve/export code to consult."""
    lineage = read_lineage(artifact) or {}
    return {"sample_images": True, "embeddings": True, "predictions": True, **lineage.get("outputs", {})}

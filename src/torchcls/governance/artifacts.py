"""Exporters' artifacts in the audit log: each published artifact registered under its own lineage id.

The artifact gets a sidecar (provenance/sidecars.py) naming its id, its parent run and the hash of its
audit record; the log gets both files' hashes, so a changed byte is caught by `torchcls verify`.
`export` announces what it published (torchcls.events.ArtifactExported); `on_artifact_exported`
registers it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from torchcls.console import console
from torchcls.errors import UserError
from torchcls.events import ArtifactExported
from torchcls.governance.log_search import artifacts_of
from torchcls.provenance.digest import sha256_file
from torchcls.provenance.keys import load_key
from torchcls.provenance.lineage import AuditLog
from torchcls.provenance.records import ChainCheck
from torchcls.provenance.sidecars import read_lineage, sidecar
from torchcls.provenance.signatures import Trusted, check_signatures
from torchcls.provenance.signing import Signer, short, signer_from
from torchcls.run_files import write_text_atomic


def register_artifact(path: str | Path, source_checkpoint: str | Path, kind: str = "export",
                      details: dict[str, Any] | None = None, key_file: str | None = None,
                      sha256: str | None = None, signing_key_file: str | None = None) -> str:
    """For exporters: record `path` (built from `source_checkpoint`) in the audit log; returns its lineage id.

    The source checkpoint must carry a lineage id (runs stamp theirs), and that lineage is a claim until the
    log it names backs it: the named run's record must list this very checkpoint (its SHA-256) among what the
    run produced (`backed_parent`), so a received checkpoint whose metadata names a run of the user's log is
    not registered, or signed, as that run's. The new artifact gets a
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
    _check_registrable(parent, source_checkpoint)
    artifact_id = uuid.uuid4().hex
    log_path = Path(parent["audit_log"])
    parent_sha256 = sha256_file(source_checkpoint)
    signer = signer_from(signing_key_file, near=[log_path.parent])
    key = load_key(key_file, near=[log_path.parent])
    backing = backed_parent(AuditLog(log_path), parent, parent_sha256, source_checkpoint, signer, key)
    log = AuditLog(log_path, key, signer)
    digest = sha256 or sha256_file(path)
    record = log.append("artifact", {"artifact_id": artifact_id, "parent_run_id": parent["run_id"],
                                     "parent_sha256": parent_sha256, "path": str(path.resolve()),
                                     "sha256": digest, "artifact_kind": kind, "details": details or {}})
    if signer is not None:
        from torchcls.provenance.attestation import statement, write_attestation

        write_attestation(path, statement(path, digest, source_checkpoint, parent_sha256, _manifests(backing), kind,
                                          details or {}, artifact_id), signer)
    lineage = {"run_id": parent["run_id"], "artifact_id": artifact_id, "audit_log": parent["audit_log"],
               "outputs": parent.get("outputs", {}), "chain_head": {"seq": record["seq"], "hash": record["hash"]},
               **{k: parent[k] for k in ("policy", "key_id", "signer") if k in parent},
               **({"signer": signer.keyid} if signer is not None else {})}
    write_text_atomic(sidecar(path), json.dumps(lineage, indent=2, sort_keys=True))
    return artifact_id


class UnbackedLineage(UserError):
    """A checkpoint's lineage names a run whose record does not list that checkpoint."""


def _check_registrable(parent: dict[str, Any], checkpoint: Path) -> None:
    """A lineage names both its run and its log, else nothing can back it. The schema (Lineage) leaves both
    optional, and a missing run id must never match a run record that lacks one too (None == None)."""
    missing = [k for k in ("run_id", "audit_log") if not parent.get(k)]  # (a str where present: Lineage)
    if missing:
        raise UnbackedLineage(f"{checkpoint}: its lineage names no {' and no '.join(missing)}, so no run of an audit "
                              "log can back it: it was not written by a torchcls run (export a checkpoint of your "
                              "own runs to register it)")


def backed_parent(log: AuditLog, parent: dict[str, Any], parent_sha256: str, checkpoint: Path,
                  signer: Signer | None = None, hmac_key: bytes | None = None) -> dict[str, Any]:
    """The record of the run that `parent` (a checkpoint's lineage) names which lists a file with `parent_sha256`
    among the run's artifacts (the last such: a resumed run records itself again), in `log` read once.
    Refused (UnbackedLineage) unless the log is an intact chain holding such a record and, when the export
    is to be signed with `signer` (or the legacy `hmac_key`), that record is signed by that very key. The
    log is the one the checkpoint names, so it may have come with it: a log shipped beside a received run
    dir could list anything, and a user's key signs only what the user's key recorded."""
    chain, backing = ChainCheck(), None
    for e in log.entries():  # one pass: the chain's links and the record that backs the checkpoint
        chain.feed(e)
        if (e.record and e.record["kind"] == "run" and e.record.get("run_id")  # (a str: records.RunRecord)
                and e.record["run_id"] == parent.get("run_id")
                and any(a["sha256"] == parent_sha256 for a in artifacts_of(e.record))):
            backing = e
    broken = [p for p in chain.all_problems() if not p.torn]
    if broken:
        raise UnbackedLineage(f"{checkpoint} names the audit log {log.path}, which is not an intact chain "
                              f"({broken[0]})")
    if backing is None:
        raise UnbackedLineage(f"{checkpoint} (sha256 {parent_sha256[:16]}…) names run {parent.get('run_id')} of "
                              f"{log.path}, which recorded no such checkpoint: its lineage is a claim the log does "
                              "not back (a run still training records itself when it ends: export again after that)")
    if signer is not None and check_signatures([backing], Trusted(ids=frozenset({signer.keyid}))).problems:
        raise UnbackedLineage(f"{checkpoint}: the record of run {parent.get('run_id')} in {log.path} is not signed by "
                              f"the key that would sign this export ({short(signer.keyid)}…): it was not this key's "
                              "run")
    if hmac_key is not None and check_signatures([backing], Trusted(hmac=hmac_key)).problems:
        raise UnbackedLineage(f"{checkpoint}: the record of run {parent.get('run_id')} in {log.path} is not signed by "
                              "the audit key that would sign this export: it was not this key's run")
    return backing.record


def _manifests(run_record: dict[str, Any]) -> list[dict[str, Any]]:
    """The data manifests a run record lists by digest (typed by records.RunManifest where the log was read)."""
    return run_record.get("manifests", [])


def register_export(path: Path, checkpoint: Path, details: dict[str, Any], sha256: str | None = None) -> str | None:
    """`torchcls export`: register the published artifact (`sha256`: its digest taken right after the
    build) when its checkpoint carries a lineage id."""
    try:
        parent = read_lineage(checkpoint)
    except UserError as e:  # a lineage of another shape (read_lineage types it): a received checkpoint's claim too
        console.print(f"{path} was exported; not registered in the audit log: {e}", highlight=False)
        return None
    if parent is None or not Path(parent.get("audit_log", "")).is_file():
        return None
    try:
        return register_artifact(path, checkpoint, kind=f"export-{details.get('target', '')}", details=details,
                                 sha256=sha256)
    except UnbackedLineage as e:  # a received checkpoint's claim: the artifact itself is built and checked
        console.print(f"{path} was exported; not registered in the audit log: {e}", highlight=False)
        return None
    except UserError as e:
        raise UserError(f"{path} was exported but not registered in the audit log: {e}") from None


def on_artifact_exported(event: ArtifactExported) -> None:
    """`export` published an artifact (torchcls.events; torchcls.consumers subscribes this)."""
    register_export(event.path, event.checkpoint, event.details, sha256=event.sha256)

"""A received audit log, as a sender could ship one beside an artifact (review 4's r3/mk.py): a run record that
names the artifact and a manifest kept in the log's manifest store. For the tests of what verify makes of it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torchcls.governance.manifest import manifest_hash
from torchcls.provenance.lineage import AuditLog, manifest_store


def stored_run(tmp_path: Path, manifest: dict[str, Any], **run: Any) -> tuple[Path, Path]:
    """(the artifact, the log): `manifest` stored, the run record in region eu-1 with no policy unless `run` says."""
    artifact = tmp_path / "a.bin"
    artifact.write_bytes(b"artifact")
    log = AuditLog(tmp_path / "log" / "audit.jsonl")
    store = manifest_store(log.path)
    store.mkdir(parents=True)
    mh = manifest_hash(manifest)
    (store / f"{mh}.json").write_text(json.dumps(manifest))
    log.append("run", {"run_id": "r", "region": "eu-1", "policy": {},
                       "artifacts": [{"path": str(artifact), "sha256": hashlib.sha256(b"artifact").hexdigest()}],
                       "manifests": [{"name": "x", "manifest_sha256": mh, "records": 1, "manifest_hash_version": 2,
                                      "merkle_root": manifest.get("tc:merkleRoot", "")}], **run})
    return artifact, log.path

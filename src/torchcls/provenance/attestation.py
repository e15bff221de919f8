"""An exported artifact's provenance as an in-toto attestation that anyone with the public key can check.

The attestation is an in-toto Statement v1 (https://in-toto.io/Statement/v1): its subject is the
artifact (file name and SHA-256), its predicate SLSA Provenance v1 (https://slsa.dev/provenance/v1)
with the source checkpoint and the training data's manifests as resolvedDependencies. It is signed in
a DSSE envelope (dsse.py) and written beside the artifact as `<artifact>.intoto.jsonl`, one envelope
on one line, the layout SLSA's generators use. It needs neither the audit log nor network access:
`torchcls governance verify-attestation ARTIFACT --public-key KEY.pub.pem`.

A manifest's digest is torchcls's manifest hash: the SHA-256 of the manifest's canonical JSON
(sorted keys, no whitespace), the name it is stored under in `_governance/manifests/`.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.errors import UserError
from torchcls.io_files import read_bytes
from torchcls.provenance import dsse
from torchcls.provenance.signing import Signer, short, verify_signature
from torchcls.run_files import write_text_atomic

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:torchcls:buildtype:export:v1"
BUILDER_ID = "urn:torchcls:builder:export"
MAX_ATTESTATION_BYTES = 1 << 20  # an attestation is a few KB; a larger file is refused unread
# The DSSE envelope (payloadType, the base64 payload, a few signatures) and the in-toto Statement in its payload
# (subjects, the SLSA predicate: a few dozen values and a dependency per manifest), parsed under these bounds.
ENVELOPE_BOUNDS = JsonBounds(max_bytes=MAX_ATTESTATION_BYTES, max_values=10_000, max_depth=4,
                             max_str=MAX_ATTESTATION_BYTES)
STATEMENT_BOUNDS = JsonBounds(max_bytes=MAX_ATTESTATION_BYTES, max_values=100_000, max_depth=16, max_str=1 << 16)


def attestation_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".intoto.jsonl")


def statement(artifact: Path, digest: str, source: Path, source_sha256: str, manifests: list[dict[str, Any]],
              kind: str, details: dict[str, Any], invocation: str) -> dict[str, Any]:
    """The in-toto Statement for `artifact` (SHA-256 `digest`), built from `source` with data `manifests`
    (the run record's manifest summaries)."""
    from torchcls.version import __version__

    deps = [{"name": source.name, "uri": source.resolve().as_uri(), "digest": {"sha256": source_sha256},
             "annotations": {"role": "source-checkpoint"}}]
    deps += [{"name": f"data manifest {m.get('name')}", "digest": {"sha256": m["manifest_sha256"]},
              "annotations": {"role": "data-manifest", "merkleRoot": m.get("merkle_root"),
                              "records": m.get("records"), "digestOf": "canonical JSON of the manifest"}}
             for m in manifests]
    return {"_type": STATEMENT_TYPE, "subject": [{"name": artifact.name, "digest": {"sha256": digest}}],
            "predicateType": SLSA_PROVENANCE,
            "predicate": {"buildDefinition": {"buildType": BUILD_TYPE,
                                              "externalParameters": {"kind": kind, **details},
                                              "resolvedDependencies": deps},
                          "runDetails": {"builder": {"id": BUILDER_ID, "version": {"torchcls": __version__}},
                                         "metadata": {"invocationId": invocation, "finishedOn": _now()}}}}


def write_attestation(artifact: Path, stmt: dict[str, Any], signer: Signer) -> Path:
    """Sign `stmt` and write it beside `artifact` (atomically: a reader never sees half of it)."""
    env = dsse.sign(dsse.INTOTO_TYPE, json.dumps(stmt, sort_keys=True).encode(), signer)
    target = attestation_path(artifact)
    write_text_atomic(target, json.dumps(env.to_json(), sort_keys=True) + "\n")  # (a link there is replaced)
    return target


def verify_attestation(artifact: Path, digest: str, trusted: dict[str, Any]) -> tuple[bool | None, str]:
    """(True, what it proves), (False, what is wrong) or (None, why it was not checked: no trusted key).
    `trusted`: key id -> public key (signing.load_public_key)."""
    side = attestation_path(artifact)
    try:
        env = dsse.parse(load_bounded(read_bytes(side, max_bytes=MAX_ATTESTATION_BYTES, what="attestation"),
                                      ENVELOPE_BOUNDS, str(side)))
        if env.payload_type != dsse.INTOTO_TYPE:
            raise ValueError(f"payloadType {env.payload_type[:80]!r} is not in-toto's")
        stmt = load_bounded(env.payload, STATEMENT_BOUNDS, f"{side}: payload")
        subjects = _subjects(stmt)
    except (OSError, UserError, ValueError, RecursionError) as e:  # (not a regular file, or too large: UserError)
        return False, f"{side.name} is not a well-formed signed in-toto statement ({str(e)[:200]})"
    signers = [k for k, _ in env.signatures]
    if not trusted:
        return None, (f"{side.name} is signed by sha256:{', sha256:'.join(short(k) + '…' for k in signers)}; not "
                      "checked: no trusted public key given (--public-key FILE)")
    good = [k for k, sig in env.signatures if k in trusted and verify_signature(trusted[k], sig, env.signed_bytes())]
    if not good:
        return False, (f"{side.name} carries no valid signature by a trusted key (signed by "
                       f"{', '.join(short(k) for k in signers)}; trusted: {', '.join(short(k) for k in trusted)})")
    if digest not in subjects.values():
        return False, (f"{side.name} is signed by trusted key sha256:{short(good[0])}… but attests "
                       f"{', '.join(f'{n} ({d[:16]}…)' for n, d in subjects.items())}, not this file (sha256 "
                       f"{digest[:16]}…): the artifact was changed after it was signed")
    build = stmt["predicate"].get("buildDefinition")
    deps = build.get("resolvedDependencies") if isinstance(build, dict) else None
    deps = deps if isinstance(deps, list) else []
    return True, (f"in-toto statement signed by trusted key sha256:{short(good[0])}…: subject sha256 {digest[:16]}…, "
                  f"{len(deps)} resolved dependencies (source checkpoint, data manifests)")


def _subjects(stmt: Any) -> dict[str, str]:
    """{subject name: sha256} of a Statement v1 with SLSA provenance; ValueError when it is not one."""
    if not isinstance(stmt, dict) or stmt.get("_type") != STATEMENT_TYPE:
        raise ValueError(f"_type is not {STATEMENT_TYPE}")
    if stmt.get("predicateType") != SLSA_PROVENANCE or not isinstance(stmt.get("predicate"), dict):
        raise ValueError(f"predicateType is not {SLSA_PROVENANCE}")
    subj = stmt.get("subject")
    if not isinstance(subj, list) or not subj or not all(
            isinstance(s, dict) and isinstance(s.get("digest"), dict) and isinstance(s["digest"].get("sha256"), str)
            for s in subj):
        raise ValueError("subject must list {name, digest: {sha256}}")
    return {str(s.get("name")): s["digest"]["sha256"] for s in subj}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")

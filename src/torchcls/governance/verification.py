"""`torchcls verify ARTIFACT`: re-hash the artifact, check the audit log's chain, its signatures and
anchors, walk back to the run and its data manifests, re-hash the data files when present, and
check the policy.

What a PASS proves, and against whom:
- The artifact is byte for byte the file the log records (artifact hash), produced by the
  recorded run from data whose manifest still hashes to what the run recorded (dateCreated, which
  drives retention, included), and the data files on disk still match it (data).
- Audit log chain: no record was changed, removed, inserted or reordered by someone who did not
  also recompute the chain. On its own this is no defence against a deliberate editor.
- Audit log signatures (when a key is given: --audit-key-file or TORCHCLS_AUDIT_KEY): every record
  was written by a holder of the key, as it stands. Against anyone without the key, a record cannot
  be added, changed, removed from the middle or re-linked. Not against a key holder; and a log
  cut off at its end, or swapped for an older copy, still verifies: the anchors catch that.
- Audit log anchors: the records pinned outside the log (the chain head in a checkpoint's metadata
  or an export's sidecar, the run record's hash in the run's lineage.json) are still in the log
  unchanged. Against anyone who can rewrite the log but not those files (an artifact already
  deployed or copied elsewhere, a run dir kept read-only or backed up).
Nothing here is proof against someone who can rewrite the log, the artifacts and the run dir and
holds the key (or where there is no key). A torn last line (an interrupted append) is reported,
not failed: no complete record is missing.

Data files are re-read by default (`rehash=True`): a file whose mtime was restored on purpose would
fool the hash cache that training uses. `rehash=False` trusts that cache for unchanged files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.governance.anchors import check_pins, pins_of
from torchcls.governance.artifacts import read_lineage
from torchcls.governance.digest import sha256_file
from torchcls.governance.hashcache import CACHE_FILE, HashCache
from torchcls.governance.integrity import check_data
from torchcls.governance.keys import KEY_ENV, key_id, load_key
from torchcls.governance.lineage import STORE_DIR, AuditLog, manifest_store
from torchcls.governance.manifest import content_key, manifest_hash, records_root
from torchcls.governance.policy import facts_of, load_policy, policy_from_dict, violations


@dataclass
class Check:
    name: str
    status: str  # pass, fail, skip
    detail: str


@dataclass
class VerifyResult:
    artifact: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(Check(name, "skip" if ok is None else "pass" if ok else "fail", detail))

    def to_dict(self) -> dict[str, Any]:
        return {"artifact": self.artifact, "ok": self.ok, "checks": [c.__dict__ for c in self.checks]}


def find_audit_log(artifact: Path, lineage: dict[str, Any] | None, given: str | None) -> Path:
    if given:
        return Path(given)
    if lineage and Path(lineage.get("audit_log", "")).is_file():
        return Path(lineage["audit_log"])
    for parent in artifact.resolve().parents:  # runs/<name>/checkpoints/x -> runs/_governance/audit.jsonl
        if (parent / STORE_DIR / "audit.jsonl").is_file():
            return parent / STORE_DIR / "audit.jsonl"
    raise UserError(f"no audit log found for {artifact}: pass --audit-log FILE")


def verify(artifact: str | Path, policy: str | None = None, audit_log: str | None = None,
           rehash: bool = True, key_file: str | None = None) -> VerifyResult:
    """Every check of `artifact`'s provenance. `rehash=False`: data files unchanged since they were
    hashed (same size, mtime and inode, per the cache beside the audit log) are not read again.
    `key_file`: the audit key (default: $TORCHCLS_AUDIT_KEY), to check the records' signatures."""
    artifact = Path(artifact)
    if not artifact.is_file():
        raise UserError(f"artifact {artifact} does not exist")
    res = VerifyResult(str(artifact))
    digest = sha256_file(artifact)
    lineage = read_lineage(artifact)
    log = AuditLog(find_audit_log(artifact, lineage, audit_log))
    problems = log.check_chain()
    torn = [p for p in problems if p.torn]
    problems = [p for p in problems if not p.torn]
    res.add("audit log chain", not problems, (f"{log.path}: intact" if not problems else _listed(problems))
            + ("; " + _listed(torn) if torn else ""))
    _check_signatures(res, log, load_key(key_file, near=[log.path.parent]), lineage)
    records = [r for _, r, _ in log.records() if r]
    pins = pins_of(artifact, lineage, records)
    bad, good = check_pins(pins, records)
    res.add("audit log anchors", None if not pins else not bad, "; ".join(bad or good) if pins else
            "no pinned record hash found for this artifact (made before pins were recorded, and no lineage.json)")
    run = _artifact_and_run(res, log, artifact, digest, lineage)
    if run is None:
        return res
    _check_manifests(res, log, run, HashCache(None if rehash else log.path.parent / CACHE_FILE))
    _check_policy(res, run, policy)
    return res


def _listed(items: list) -> str:
    return "; ".join(str(p) for p in items[:5]) + (f" (+{len(items) - 5} more)" if len(items) > 5 else "")


def _check_signatures(res: VerifyResult, log: AuditLog, key: bytes | None, lineage: dict[str, Any] | None) -> None:
    if key is not None:
        problems = log.check_signatures(key)
        res.add("audit log signatures", not problems, _listed(problems) if problems else
                f"every record signed with key id {key_id(key)}")
        return
    # Without the key no signature can be checked, but a log does not go from signed to unsigned: a
    # signed log refuses unsigned appends (AuditLog._check_key), so an unsigned record after a signed
    # one, or an unsigned log under an artifact whose lineage names a key, had its signatures stripped.
    records = [(n, r) for n, r, _ in log.records() if r]
    first_signed = next((i for i, (_, r) in enumerate(records) if r.get("key_id")), None)
    after = records[first_signed:] if first_signed is not None else []
    stripped = [f"audit log line {n}: record seq {r.get('seq')} is unsigned after signed records (its signature "
                "was removed)" for n, r in after if not (r.get("key_id") and r.get("hmac"))]
    named = (lineage or {}).get("key_id")
    if named and first_signed is None:
        stripped.append(f"{res.artifact}'s lineage says its run signed the log (key id {named}), but no record "
                        "in it is signed: the signatures were removed")
    signers = sorted({r["key_id"] for _, r in records if r.get("key_id")})
    res.add("audit log signatures", False if stripped else None, _listed(stripped) if stripped else
            f"records are signed (key id {', '.join(signers)}) but no key was given ({KEY_ENV} or "
            "--audit-key-file): not checked" if signers else
            "the log is unsigned (no audit key was set when it was written)")


def _artifact_and_run(res: VerifyResult, log: AuditLog, artifact: Path, digest: str,
                      lineage: dict[str, Any] | None) -> dict[str, Any] | None:
    records = [r for _, r, _ in log.records() if r]
    produced = [(r, a) for r in records for a in _artifacts_of(r) if a["sha256"] == digest]
    if lineage is None and not produced:
        res.add("artifact hash", False, f"{artifact} (sha256 {digest[:16]}…) carries no readable lineage id and its "
                                        "hash matches no artifact in the audit log: modified, or not produced by a "
                                        "recorded run")
        return None
    if lineage is not None:
        run_id = lineage.get("run_id")
        claimed = [(r, a) for r in records for a in _artifacts_of(r)
                   if r.get("run_id") == run_id or r.get("parent_run_id") == run_id]
        mine = [(r, a) for r, a in claimed if Path(a["path"]).name == artifact.name and
                (lineage.get("artifact_id") is None or r.get("artifact_id") == lineage.get("artifact_id"))]
        if not claimed:
            res.add("lineage id", False, f"{artifact} names run {run_id}, which has no record in {log.path}")
            return None
        if not any(a["sha256"] == digest for _, a in mine):
            recorded = mine[-1][1]["sha256"][:16] + "…" if mine else "nothing"
            res.add("artifact hash", False, f"{artifact}: sha256 {digest[:16]}… differs from what run {run_id} "
                                            f"recorded ({recorded}): the file was modified after it was produced")
            return None
        produced = [(r, a) for r, a in mine if a["sha256"] == digest]
    rec, art = produced[-1]
    res.add("artifact hash", True, f"sha256 {digest[:16]}… recorded in audit record seq {rec['seq']}")
    run_id = rec.get("run_id") or rec.get("parent_run_id")
    runs = [r for r in records if r.get("kind") == "run" and r.get("run_id") == run_id]
    if not runs:
        res.add("run record", False, f"run {run_id} has no 'run' record in {log.path}")
        return None
    res.add("run record", True, f"run {run_id} (seq {runs[-1]['seq']}, {runs[-1].get('run_dir')}, "
                                f"code {runs[-1].get('code_version')})")
    return runs[-1]


def _artifacts_of(rec: dict[str, Any]) -> list[dict[str, Any]]:
    if rec.get("kind") == "run":
        return rec.get("artifacts", [])
    if rec.get("kind") == "artifact":
        return [{"path": rec["path"], "sha256": rec["sha256"]}]
    return []


def _check_manifests(res: VerifyResult, log: AuditLog, run: dict[str, Any], cache: HashCache) -> None:
    for m in run.get("manifests", []):
        path = manifest_store(log.path) / f"{m['manifest_sha256']}.json"
        if not path.is_file():
            res.add(f"manifest {m['name']}", False, f"{path} is missing from the manifest store")
            continue
        manifest = json.loads(path.read_text())
        legacy = m.get("manifest_hash_version", 1) < 2  # recorded before dateCreated was hashed
        digest = content_key(manifest) if legacy else manifest_hash(manifest)
        if digest != m["manifest_sha256"] or records_root(manifest["tc:records"]) != m["merkle_root"]:
            res.add(f"manifest {m['name']}", False, f"{path} was modified: it no longer hashes to the recorded "
                                                    f"{m['manifest_sha256'][:16]}… / Merkle root {m['merkle_root'][:16]}…")
            continue
        res.add(f"manifest {m['name']}", True, f"{m['records']} records, Merkle root {m['merkle_root'][:16]}…"
                + (" (recorded by an older torchcls: its dateCreated is not covered by the hash)" if legacy else ""))
        if not Path(manifest["tc:root"]).exists():
            res.add(f"data {m['name']}", None, f"{manifest['tc:root']} is not present here: files not re-checked")
            continue
        problems = check_data(manifest, cache=cache)
        res.add(f"data {m['name']}", not problems, "all files match the manifest" if not problems else
                "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
        run["_facts"] = facts_of(manifest)


def _check_policy(res: VerifyResult, run: dict[str, Any], policy_file: str | None) -> None:
    if policy_file:
        policy, origin = load_policy(policy_file), policy_file
    elif run.get("policy"):
        policy, origin = policy_from_dict(_as_toml_dict(run["policy"]), "recorded"), "the run's recorded policy"
    else:
        res.add("policy", None, "the run had no policy and none was given (--policy FILE)")
        return
    facts = run.get("_facts")
    if facts is None:
        res.add("policy", False, "the data's manifest could not be read, so the policy cannot be checked")
        return
    reasons = violations(policy, facts, run.get("region"), set(run.get("hooks", [])))
    res.add(f"policy ({origin})", not reasons, "; ".join(reasons) if reasons else
            f"'{policy.name}': region, license, jurisdictions, retention and hooks all allowed")


def _as_toml_dict(p: dict[str, Any]) -> dict[str, Any]:
    """A recorded Policy (flat dataclass dict) back into the TOML layout policy_from_dict reads."""
    sections = {"policy": ["name", "description"], "processing": ["allowed_regions"],
                "data": ["allowed_licenses", "allowed_jurisdictions", "mix_jurisdictions", "require_legal_basis",
                         "require_retention", "max_retention_days"],
                "outputs": ["sample_images", "embeddings", "predictions", "restricted_tags"]}
    out = {s: {k: p[k] for k in keys if p.get(k) is not None} for s, keys in sections.items()}
    return {**out, "hooks": p.get("hooks", {}), "residency": p.get("residency", {})}

"""`torchcls verify ARTIFACT`: re-hash the artifact, check the audit log's lines, chain, signatures and
anchors, the artifact's in-toto attestation, walk back to the run and its data manifests, re-hash the
data files when present, and check the policy. The result is verified, unverified or failed
(logcheck.py): only "verified" claims provenance, and only under a key the verifier brought.

What each check proves, and against whom:
- The artifact is byte for byte the file the log records (artifact hash), produced by the
  recorded run from data whose manifest still hashes to what the run recorded (dateCreated, which
  drives retention, included), and the data files on disk still match it (data).
- Audit log chain: every line is a record (a torn last line aside) and none was changed, removed,
  inserted or reordered by someone who did not also recompute the chain. On its own this is no
  defence against a deliberate editor.
- Audit log signatures, with a trusted public key (--public-key, $TORCHCLS_TRUSTED_KEYS, a --policy's
  [provenance] trusted_keys): every record was signed by the holder of a trusted private key, as it
  stands. Nobody else can add, change, re-link or re-sign a record, and the public key lets anyone
  check it. With the legacy HMAC key (--audit-key-file, $TORCHCLS_AUDIT_KEY) the same holds only
  against people without that secret, and every verifier holds it. A log cut off at its end, or
  swapped for an older copy, still verifies: the anchors catch that.
- Audit log anchors: the records pinned outside the log (the chain head in a checkpoint's metadata
  or an export's sidecar, the run record's hash in the run's lineage.json) are still in the log
  unchanged. Against anyone who can rewrite the log but not those files.
- Attestation (exports signed with a key pair): `<artifact>.intoto.jsonl` names this file's SHA-256
  and is signed by a trusted key (attestation.py).
Without a trusted key nothing here is proof of who wrote the log: the result is then "unverified".

Data files are re-read by default (`rehash=True`): a file whose mtime was restored on purpose would
fool the hash cache that training uses. `rehash=False` trusts that cache for unchanged files, and only
the cache of the user's own runs (`out_dir`, which the user names): the store beside the audit log may
have come with the artifact, and a received cache could claim any file unchanged (hashcache.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.config import RunConfig
from torchcls.errors import UserError
from torchcls.governance.anchors import check_pins, pins_of
from torchcls.governance.hashcache import CACHE_FILE, HashCache
from torchcls.governance.integrity import check_data
from torchcls.governance.log_search import ArtifactSearch, second_pass
from torchcls.governance.logcheck import VerifyResult, check_log, listed, scan_log
from torchcls.governance.manifest import (
    MAX_MANIFEST_BYTES,
    content_key,
    manifest_hash,
    parse_manifest_json,
    records_root,
)
from torchcls.governance.policy import DataFacts, Policy, facts_of, load_policy, policy_from_dict, violations
from torchcls.io_files import read_bytes
from torchcls.provenance.attestation import attestation_path, verify_attestation
from torchcls.provenance.digest import sha256_file
from torchcls.provenance.lineage import STORE_DIR, AuditLog, manifest_store
from torchcls.provenance.sidecars import read_lineage
from torchcls.provenance.signatures import Trusted, trusted_from

__all__ = ["VerifyResult", "find_audit_log", "verify"]


def find_audit_log(artifact: Path, lineage: dict[str, Any] | None, given: str | None) -> Path:
    if given:
        return Path(given)
    if lineage and Path(str(lineage.get("audit_log", ""))).is_file():
        return Path(lineage["audit_log"])
    for parent in artifact.resolve().parents:  # runs/<name>/checkpoints/x -> runs/_governance/audit.jsonl
        if (parent / STORE_DIR / "audit.jsonl").is_file():
            return parent / STORE_DIR / "audit.jsonl"
    raise UserError(f"no audit log found for {artifact}: pass --audit-log FILE")


def verify(artifact: str | Path, policy: str | None = None, audit_log: str | None = None,
           rehash: bool = True, key_file: str | None = None, public_keys: list[str] | None = None,
           out_dir: str | Path | None = None) -> VerifyResult:
    """Every check of `artifact`'s provenance. `rehash=False`: data files unchanged since they were
    hashed (same size, mtime and inode, per the hash cache of the user's runs in `out_dir`, default train's runs/)
    are not read again.
    `public_keys`: trusted public key files (default: $TORCHCLS_TRUSTED_KEYS); `key_file`: the legacy
    HMAC audit key (default: $TORCHCLS_AUDIT_KEY); `policy`: its [provenance] adds trusted key ids and
    may require signatures (the run's recorded policy is never trusted for keys: it lives in the log)."""
    artifact = Path(artifact)
    if not artifact.is_file():
        raise UserError(f"artifact {artifact} does not exist or is not a regular file")
    cache = _own_cache(rehash, out_dir)
    given = load_policy(policy) if policy else None
    res = VerifyResult(str(artifact))
    digest = sha256_file(artifact)
    lineage = read_lineage(artifact)  # (a dict of Lineage's shape, or None)
    log = AuditLog(find_audit_log(artifact, lineage, audit_log))
    trusted = trusted_from(key_file, public_keys, given, near=[log.path.parent])
    search = ArtifactSearch(artifact, digest, lineage)
    with log.open() as f:  # streamed twice (log_search.py): only the few records verify needs are kept
        scan = scan_log(f, trusted, search.see)
        check_log(res, log, scan, trusted, lineage)
        pins = pins_of(artifact, lineage, search.run_records())
        seqs = {pin.get("seq") for _, pin in pins if type(pin.get("seq")) is int}
        pinned, run, same, parent_listed = second_pass(f, scan.chain, seqs, search.produced_run(),
                                                       search.produced_parent())
    if not same:
        res.add("audit log", False, f"{log.path} changed while it was being verified: verify it again")
        return res
    bad, good = check_pins(pins, pinned)
    res.add("audit log anchors", None if not pins else not bad, "; ".join(bad or good) if pins else
            "no pinned record hash found for this artifact (made before pins were recorded, and no lineage.json)")
    _check_attestation(res, artifact, digest, trusted)
    if not _artifact_and_run(res, log, search, run, parent_listed):
        return res
    facts = _check_manifests(res, log, run, cache)
    _check_policy(res, run, facts, given, policy)
    return res


def _own_cache(rehash: bool, out_dir: str | Path | None) -> HashCache:
    """The hash cache verify may trust: none with `rehash`, else the one of the user's own runs (which verify keeps
    up to date, as their runs do). Never the one beside the audit log: that log is the one the artifact names,
    so both may have come with it."""
    if rehash:
        return HashCache(None)
    store = Path(out_dir or RunConfig().out_dir) / STORE_DIR  # (by default train's out dir, as the user's runs use)
    return HashCache(store / CACHE_FILE if store.is_dir() else None)  # no store there: every file is re-read


def _check_attestation(res: VerifyResult, artifact: Path, digest: str, trusted: Trusted) -> None:
    if not attestation_path(artifact).exists():
        return  # only exports signed with a key pair carry one
    ok, detail = verify_attestation(artifact, digest, trusted.public)
    res.add("attestation", ok, detail)


def _artifact_and_run(res: VerifyResult, log: AuditLog, search: ArtifactSearch, run: dict[str, Any] | None,
                      parent_listed: bool) -> bool:
    """Whether a record produced the artifact, its run has a `run` record (`run`) and, for an export, a run
    record lists the checkpoint it was built from (`parent_listed`); each finding added."""
    artifact, digest, lineage = search.artifact, search.digest, search.lineage
    if lineage is None and search.produced is None:
        res.add("artifact hash", False, f"{artifact} (sha256 {digest[:16]}…) carries no readable lineage id and its "
                                        "hash matches no artifact in the audit log: modified, or not produced by a "
                                        "recorded run")
        return False
    if lineage is not None:
        if not search.claimed:
            res.add("lineage id", False, f"{artifact} names run {search.run_id}, which has no record in {log.path}")
            return False
        if search.produced is None:
            recorded = search.mine[1]["sha256"][:16] + "…" if search.mine else "nothing"
            res.add("artifact hash", False, f"{artifact}: sha256 {digest[:16]}… differs from what run "
                                            f"{search.run_id} recorded ({recorded}): the file was modified after it "
                                            "was produced")
            return False
    rec = search.produced[0]
    res.add("artifact hash", True, f"sha256 {digest[:16]}… recorded in audit record seq {rec['seq']}")
    run_id = search.produced_run()
    if run is None:
        res.add("run record", False, f"run {run_id} has no 'run' record in {log.path}")
        return False
    res.add("run record", True, f"run {run_id} (seq {run['seq']}, {run.get('run_dir')}, code {run.get('code_version')})")
    parent = search.produced_parent()
    if parent is not None:  # an export: its record's claim about its checkpoint, held against what the run made
        res.add("source checkpoint", parent_listed, f"sha256 {str(parent)[:16]}… " + (
            f"is a checkpoint run {run_id} recorded" if parent_listed else
            f"was not recorded by run {run_id}: the export's lineage is a claim the log does not back"))
        return parent_listed
    return True


def _check_manifests(res: VerifyResult, log: AuditLog, run: dict[str, Any], cache: HashCache) -> list[DataFacts] | None:
    """Each manifest the run record lists, looked up in the store and re-hashed, then its data files; returns the
    facts of every one for the policy, or None when any listed manifest's could not be read (a policy judged on
    some of a run's data would pass the rest unseen)."""
    # (typed by records.RunRecord where the log was read: each names its manifest by a hex digest, never by a path,
    # and its Merkle root)
    distinct, agree = _distinct(res, run.get("manifests", []))
    if not distinct:
        # A failure, not a skip: every run record torchcls writes lists its data's manifest (a built-in set's too),
        # so this one was not written by torchcls, and on a log signed by a trusted key a skip would let verify say
        # "verified" of an artifact whose data nothing here checked.
        res.add("data", False, "the run record lists no data manifest, so nothing binds the artifact to its data: "
                               "it was not written by torchcls")
    facts: list[DataFacts] | None = [] if agree else None
    for m in distinct:
        manifest = _stored_manifest(res, log, m)
        if manifest is None:
            facts = None
            continue
        if facts is not None:  # (before the data: the facts are the manifest's, whether or not its files are here)
            facts.append(facts_of(manifest))
        if not Path(manifest["tc:root"]).exists():
            res.add(f"data {m.get('name')}", None, f"{manifest['tc:root']} is not present here: files not re-checked")
            continue
        problems = check_data(manifest, cache=cache)
        res.add(f"data {m.get('name')}", not problems,
                "all files match the manifest" if not problems else listed(problems))
    return facts


def _distinct(res: VerifyResult, summaries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """One summary per manifest digest, before any is parsed: a record repeating one summary would otherwise have
    the stored manifest parsed and its data re-hashed once per copy. And whether each repeat agrees with the first
    (Merkle root, hash version): one that does not is a failed check, as a manifest that does not hash would be."""
    first: dict[str, dict[str, Any]] = {}
    agree = True
    for m in summaries:
        seen = first.setdefault(m["manifest_sha256"], m)
        if (seen["merkle_root"], seen.get("manifest_hash_version", 1)) != (m["merkle_root"],
                                                                          m.get("manifest_hash_version", 1)):
            res.add(f"manifest {m.get('name')}", False, f"manifest {m['manifest_sha256'][:16]}… is listed more than "
                                                        "once with different Merkle roots or hash versions: the run "
                                                        "record was not written by torchcls")
            agree = False
    return list(first.values()), agree


def _stored_manifest(res: VerifyResult, log: AuditLog, m: dict[str, Any]) -> dict[str, Any] | None:
    """The stored manifest `m` (a run record's summary) names, when it still hashes as recorded; else None, the
    failure added."""
    name = f"manifest {m.get('name')}"
    path = manifest_store(log.path) / f"{m['manifest_sha256']}.json"
    if not path.is_file():
        res.add(name, False, f"{path} is missing from the manifest store")
        return None
    try:  # (typed where parsed: a field of another type is this manifest's failure, not verify's traceback)
        manifest = parse_manifest_json(read_bytes(path, max_bytes=MAX_MANIFEST_BYTES, what="stored manifest"),
                                       str(path))
    except UserError as e:
        res.add(name, False, str(e))
        return None
    try:
        legacy = m.get("manifest_hash_version", 1) < 2  # recorded before dateCreated was hashed
        digest = content_key(manifest) if legacy else manifest_hash(manifest)
        same = digest == m["manifest_sha256"] and records_root(manifest["tc:records"]) == m["merkle_root"]
    except (ValueError, KeyError, TypeError, AttributeError):
        same = False
    if not same:
        res.add(name, False, f"{path} was modified: it no longer hashes to the recorded "
                             f"{m['manifest_sha256'][:16]}… / Merkle root {m['merkle_root'][:16]}…")
        return None
    res.add(name, True, f"{m.get('records')} records, Merkle root {m['merkle_root'][:16]}…"
            + (" (recorded by an older torchcls: its dateCreated is not covered by the hash)" if legacy else ""))
    return manifest


def _check_policy(res: VerifyResult, run: dict[str, Any], facts: list[DataFacts] | None, given: Policy | None,
                  policy_file: str | None) -> None:
    if given is not None:
        policy, origin = given, policy_file
    elif run.get("policy") is not None:
        try:  # (the log may have come with the artifact: a policy of another shape fails this check, not verify)
            policy, origin = policy_from_dict(_as_toml_dict(run["policy"]), "recorded"), "the run's recorded policy"
        except UserError as e:
            res.add("policy", False, f"the run's recorded policy cannot be read ({e}): check the run against a "
                                     "policy of your own (--policy FILE)")
            return
    else:
        res.add("policy", None, "the run had no policy and none was given (--policy FILE)")
        return
    if not facts:
        res.add("policy", False, "a data manifest the run record lists could not be read, so the policy cannot be "
                                 "checked" if facts is None else "the run record lists no data manifest, so the "
                                 "policy cannot be checked")
        return
    # Each manifest judged on its own, as training judges its data and a built-in val set (run.py _check_policy):
    # every reason names its manifest (DataFacts.name); a host-wide one (region) is said once.
    region, hooks = run.get("region"), set(run.get("hooks", []))
    reasons = list(dict.fromkeys(r for f in facts for r in violations(policy, f, region, hooks)))
    res.add(f"policy ({origin})", not reasons, "; ".join(reasons) if reasons else
            f"'{policy.name}': region, license, jurisdictions, retention and hooks all allowed")


def _as_toml_dict(p: dict[str, Any]) -> dict[str, Any]:
    """A recorded Policy (flat dataclass dict) back into the TOML layout policy_from_dict reads."""
    sections = {"policy": ["name", "description"], "processing": ["allowed_regions"],
                "data": ["allowed_licenses", "allowed_jurisdictions", "mix_jurisdictions", "require_legal_basis",
                         "require_retention", "max_retention_days"],
                "outputs": ["sample_images", "embeddings", "predictions", "restricted_tags"],
                "provenance": ["require_signatures", "trusted_keys"]}
    out = {s: {k: p[k] for k in keys if p.get(k) is not None} for s, keys in sections.items()}
    return {**out, "hooks": p.get("hooks", {}), "residency": p.get("residency", {})}

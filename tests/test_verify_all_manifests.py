"""verify reads every data manifest a run record lists, once each (review 7).

A run record lists its training data's manifest and, with --val-data, the validation set's. verify judged the
policy on the last manifest only (F1): training data under a forbidden license passed when the val data was fine.
Each test builds real manifests of real image folders and a log as a sender could ship one beside an artifact."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import make_image_folder
from torchcls.errors import UserError
from torchcls.governance.manifest import MANIFEST_HASH_VERSION, DatasetMeta, build_manifest, manifest_hash
from torchcls.governance.verification import verify
from torchcls.provenance.lineage import AuditLog, manifest_store, record_hash

POLICY = '[policy]\nname = "eu"\n[data]\nallowed_licenses = ["CC-BY-4.0"]\nallowed_jurisdictions = ["EU"]\n'


def _summary(m: dict[str, Any]) -> dict[str, Any]:
    """A manifest as governance/run.py `_manifest_summary` lists it in the run record."""
    return {"name": m["name"], "source": m["tc:source"], "merkle_root": m["tc:merkleRoot"],
            "manifest_sha256": manifest_hash(m), "manifest_hash_version": MANIFEST_HASH_VERSION,
            "records": len(m["tc:records"])}


@pytest.fixture
def data(tmp_path) -> dict[str, Any]:
    """Two data sets: train (proprietary, from CN: the policy forbids it) and val (CC-BY-4.0, EU: allowed)."""
    train = build_manifest(str(make_image_folder(tmp_path / "train", per_class=2)),
                           meta=DatasetMeta(name="train", license="proprietary", jurisdiction="CN"))
    val = build_manifest(str(make_image_folder(tmp_path / "val", per_class=2)),
                         meta=DatasetMeta(name="val", license="CC-BY-4.0", jurisdiction="EU"))
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    return {"train": train, "val": val, "policy": str(policy), "base": tmp_path}


def _shipped(base: Path, stored: list[dict[str, Any]], signer=None, **run: Any) -> tuple[Path, Path]:
    """(the artifact, the log): `stored` manifests in the log's store, a run record (`run`) listing the artifact,
    signed by `signer` when given."""
    artifact = base / "ship" / "model.bin"
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(b"weights")
    log = AuditLog(base / "ship" / "_governance" / "audit.jsonl", signer=signer)
    store = manifest_store(log.path)
    store.mkdir(parents=True)
    for m in stored:
        (store / f"{manifest_hash(m)}.json").write_text(json.dumps(m))
    log.append("run", {"run_id": "r1", "artifacts": [{"path": str(artifact),
                                                      "sha256": hashlib.sha256(b"weights").hexdigest()}], **run})
    return artifact, log.path


def _check(res, prefix: str) -> list[tuple[str, str]]:
    return [(c.status, c.detail) for c in res.checks if c.name.startswith(prefix)]


@pytest.mark.parametrize("train_here", [True, False], ids=["train-data-here", "train-data-elsewhere"])
def test_the_policy_is_judged_on_the_training_data_too(data, train_here):
    """F1: run["_facts"] was set per manifest in a loop, so the val manifest (listed last) replaced train's; and a
    manifest whose data root is absent never set its facts. The train manifest now fails the policy either way."""
    if not train_here:
        shutil.rmtree(data["train"]["tc:root"])
    artifact, log = _shipped(data["base"], [data["train"], data["val"]],
                             manifests=[_summary(data["train"]), _summary(data["val"])])
    res = verify(artifact, audit_log=str(log), policy=data["policy"])
    [(status, detail)] = _check(res, "policy")
    assert status == "fail" and res.status == "failed"
    assert "train: license 'proprietary' is not allowed" in detail and "train: data from jurisdiction(s) CN" in detail
    assert "val:" not in detail
    assert [s for s, _ in _check(res, "manifest")] == ["pass", "pass"]


def test_a_listed_manifest_that_cannot_be_read_fails_the_policy(data):
    """F1: a listed manifest missing from the store (or modified) left the policy judged on the others."""
    artifact, log = _shipped(data["base"], [data["val"]], manifests=[_summary(data["train"]), _summary(data["val"])])
    res = verify(artifact, audit_log=str(log), policy=data["policy"])
    assert [s for s, _ in _check(res, "manifest")] == ["fail", "pass"]
    assert _check(res, "policy") == [("fail", "a data manifest the run record lists could not be read, so the "
                                              "policy cannot be checked")]


def test_allowed_data_passes_the_policy(data):
    artifact, log = _shipped(data["base"], [data["val"]], manifests=[_summary(data["val"])])
    res = verify(artifact, audit_log=str(log), policy=data["policy"])
    assert [s for s, _ in _check(res, "policy")] == ["pass"] and res.status == "unverified", res.checks


def _forged(log: Path, change) -> None:
    """The log's run record changed by `change` and the chain recomputed, as anyone who can write the log can."""
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    change(next(r for r in recs if r["kind"] == "run"))
    prev = "0" * 64
    for rec in recs:
        rec["prev"] = prev
        rec["hash"] = prev = record_hash(rec)
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """How many times verify parses a stored manifest and re-checks data files."""
    from torchcls.governance import verification

    calls = {"parse": 0, "check_data": 0}
    parse, check = verification.parse_manifest_json, verification.check_data

    def counted_parse(*a, **k):
        calls["parse"] += 1
        return parse(*a, **k)

    def counted_check(*a, **k):
        calls["check_data"] += 1
        return check(*a, **k)

    monkeypatch.setattr(verification, "parse_manifest_json", counted_parse)
    monkeypatch.setattr(verification, "check_data", counted_check)
    return calls


def test_a_run_record_of_thousands_of_manifests_is_refused(data, counted):
    """F2: one 480 KB line repeating a summary 2,400 times made verify parse the stored manifest and re-hash the
    data 2,400 times. RunRecord.manifests is bounded (MAX_RUN_MANIFESTS): the writer refuses such a record, and a
    forged one is a problem line of the log, read no further."""
    from torchcls.errors import UserError
    from torchcls.provenance.records import MAX_RUN_MANIFESTS

    small = {k: _summary(data["val"])[k] for k in ("manifest_sha256", "merkle_root", "manifest_hash_version")}
    many = [small] * 2400  # (4 JSON values each: the line stays within the log's bound of 10,000)
    with pytest.raises(UserError, match=rf"manifests: .*at most {MAX_RUN_MANIFESTS}"):
        AuditLog(data["base"] / "new.jsonl").append("run", {"run_id": "r1", "manifests": many})
    artifact, log = _shipped(data["base"], [data["val"]], manifests=[_summary(data["val"])])
    _forged(log, lambda rec: rec.update(manifests=many))
    res = verify(artifact, audit_log=str(log))
    assert res.status == "failed" and "a run record: manifests" in _check(res, "audit log chain")[0][1]
    assert counted == {"parse": 0, "check_data": 0}


@pytest.mark.parametrize(("field", "item"), [("artifacts", {"path": "x", "sha256": "0" * 64}), ("hooks", "strip-exif")])
def test_a_run_records_other_lists_are_bounded(field, item):
    from torchcls.provenance.records import MAX_RUN_ARTIFACTS, MAX_RUN_HOOKS, record_hash, record_problem

    bound = {"artifacts": MAX_RUN_ARTIFACTS, "hooks": MAX_RUN_HOOKS}[field]
    for n, ok in ((bound, True), (bound + 1, False)):
        rec = {"seq": 0, "prev": "0" * 64, "kind": "run", "time": "t", field: [item] * n}
        rec["hash"] = record_hash(rec)
        assert (record_problem(rec) is None) == ok, record_problem(rec)


def test_a_manifest_listed_again_is_read_once(data, counted):
    """F2: verify de-duplicates the summaries by digest before it parses anything."""
    from torchcls.provenance.records import MAX_RUN_MANIFESTS

    artifact, log = _shipped(data["base"], [data["val"]], manifests=[_summary(data["val"])] * MAX_RUN_MANIFESTS)
    res = verify(artifact, audit_log=str(log), policy=data["policy"])
    assert counted == {"parse": 1, "check_data": 1}
    assert [s for s, _ in _check(res, "manifest")] == ["pass"] and res.status == "unverified", res.checks


def test_a_manifest_listed_again_with_another_root_fails(data):
    other = {**_summary(data["val"]), "merkle_root": "0" * 64}
    artifact, log = _shipped(data["base"], [data["val"]], manifests=[_summary(data["val"]), other])
    res = verify(artifact, audit_log=str(log), policy=data["policy"])
    assert [s for s, _ in _check(res, "manifest")] == ["fail", "pass"] and res.status == "failed"
    assert "listed more than once with different Merkle roots" in _check(res, "manifest")[0][1]
    assert _check(res, "policy")[0][0] == "fail"


# --- artifact records (F3): typed where the log is read, as run records are ----------------------------------

SUBSTITUTES = ([], {}, 1, "x", True, None, ["r1"])
HEX = "ab" * 32
# Every field ArtifactRecord declares, a value of its type, and whether a record may leave it out.
ARTIFACT_FIELDS = {"path": ("/runs/x/m.onnx", False), "sha256": (HEX, False), "artifact_id": ("a" * 32, True),
                   "parent_run_id": ("r1", True), "parent_sha256": (HEX, True), "artifact_kind": ("onnx", True)}


def _lineage_log(data) -> tuple[Path, Path]:
    """(an image of the val set, a log whose run r1 read it and whose export of r1 is registered)."""
    _, log = _shipped(data["base"], [data["val"]], manifests=[_summary(data["val"])])
    AuditLog(log).append("artifact", {name: value for name, (value, _) in ARTIFACT_FIELDS.items()})
    return next(Path(data["val"]["tc:root"]).rglob("*.png")), log


def _forged_artifact(log: Path, field: str, new: Any) -> None:
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    art = next(r for r in recs if r["kind"] == "artifact")
    if new == "missing":
        art.pop(field)
    else:
        art[field] = new
    prev = "0" * 64
    for rec in recs:
        rec["prev"] = prev
        rec["hash"] = prev = record_hash(rec)
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.mark.parametrize(("field", "new"), [(f, n) for f in ARTIFACT_FIELDS for n in (*SUBSTITUTES, "missing")],
                         ids=[f"{f}={n if n == 'missing' else json.dumps(n)}" for f in ARTIFACT_FIELDS
                              for n in (*SUBSTITUTES, "missing")])
def test_every_artifact_record_field_substituted(data, field, new):
    """F3: only an artifact record's sha256 was typed. `lineage --file` indexed rec["path"] and rec["parent_run_id"]
    and put parent_run_id in a set: no path was a KeyError traceback, `path: ["x"]` or `parent_run_id: ["r1"]` a
    TypeError. A record of another shape is now a problem line of the log (and refused by the writer); lineage
    --file lists it among the log's problems, and never the artifact."""
    from torchcls.errors import UserError
    from torchcls.governance.query import file_lineage

    image, log = _lineage_log(data)
    good, optional = ARTIFACT_FIELDS[field]
    export = ARTIFACT_FIELDS["path"][0]
    assert export in [a["path"] for a in file_lineage(str(image), log)["artifacts"]]
    right = optional if new == "missing" else type(new) is str and (new == good or field not in ("sha256",
                                                                                             "parent_sha256"))
    _forged_artifact(log, field, new)
    found = file_lineage(str(image), log)
    if right:
        assert not found["audit_log_problems"], found["audit_log_problems"]
        return
    assert export not in [a["path"] for a in found["artifacts"]] and found["runs"]
    assert any(f"an artifact record{': ' + field if field != 'sha256' else ''}" in p
               for p in found["audit_log_problems"]), found["audit_log_problems"]
    record = {name: value for name, (value, _) in ARTIFACT_FIELDS.items() if name != field}
    with pytest.raises(UserError, match="is not one the log's reader takes"):  # and none is written so
        AuditLog(data["base"] / "new.jsonl").append("artifact", record if new == "missing" else {**record, field: new})


# --- a run record that lists no manifest (F4) ------------------------------------------------------------------


@pytest.mark.parametrize("listed", ["valid", "absent", "empty"])
def test_a_signed_run_record_without_a_manifest_is_not_verified(data, listed):
    """F4: a summary without manifest_sha256 or merkle_root was passed over in silence, so a run record whose
    `manifests` was absent or [] got no data check at all, and on a log signed by a trusted key verify said
    "verified" with nothing about the data checked. A record that lists no manifest now fails verify's "data"
    check (every torchcls listed one)."""
    from torchcls.provenance.signing import keygen, load_signer

    private, public, _ = keygen(data["base"] / "keys")
    run = {"valid": {"manifests": [_summary(data["val"])]}, "absent": {}, "empty": {"manifests": []}}[listed]
    artifact, log = _shipped(data["base"], [data["val"]], signer=load_signer(private), **run)
    res = verify(artifact, audit_log=str(log), public_keys=[str(public)])
    if listed == "valid":
        assert res.status == "verified", [c for c in res.checks if c.status != "pass"]
        return
    assert res.status == "failed"
    assert _check(res, "data") == [("fail", "the run record lists no data manifest, so nothing binds the artifact to "
                                            "its data: it was not written by torchcls")]


@pytest.mark.parametrize("summary", [{}, {"name": "x", "records": 1}, {"manifest_sha256": HEX}, {"merkle_root": HEX}])
def test_a_manifest_summary_without_its_digest_or_root_fails(data, summary):
    """F4: `manifests: [{}]` was a run record verify read and checked nothing of, passing the policy check on no
    data. RunManifest requires both (every torchcls wrote both): the writer refuses such a record, and one forged
    into a received log is a problem line of it, so verify fails."""
    with pytest.raises(UserError, match=r"a run record: manifests\.1\.(manifest_sha256|merkle_root): field required"):
        _shipped(data["base"] / "written", [data["val"]], manifests=[_summary(data["val"]), summary])
    artifact, log = _shipped(data["base"], [data["val"]], manifests=[_summary(data["val"])])
    _forged(log, lambda rec: rec["manifests"].append(summary))
    res = verify(artifact, audit_log=str(log), policy=data["policy"])
    assert res.status == "failed"
    [(status, detail)] = _check(res, "audit log chain")
    assert status == "fail" and "a run record: manifests.1." in detail and "field required" in detail

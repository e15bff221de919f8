"""Values read from a received file are typed where the file is parsed (review 4, findings 3 and 4).

A lineage (an artifact's sidecar, a checkpoint's metadata, a run dir's lineage.json), an audit record and a data
manifest (the user's --data-manifest, or one in the store beside a received audit log) come with the files; a
value of another JSON type (`"outputs": []`, `"seq": [1]`, `"tc:root": 5`, `"expires": "not-a-date"`) used to
end predict, serve, export or verify in a TypeError, KeyError or ValueError. Each is now a UserError naming the
file and the field, or (verify) a failed check; and verify no longer reads a file a received manifest names
outside its tc:root. The "next variant" tests replace every value of a valid file in turn with each JSON type
and hold every reader and consumer to: a UserError, or a clean run; never another exception."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from received_logs import stored_run
from torchcls.errors import UserError
from torchcls.governance.manifest import parse_manifest_json, records_root
from torchcls.provenance.lineage import AuditLog
from torchcls.provenance.sidecars import LINEAGE_KEY, sidecar

SUBSTITUTES = ([], {}, 1, "x", True, None)


def _paths(value: Any, at: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, value) of every node under `value` (its containers too), the top level excluded."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found.append(((*at, k), v))
        found += _paths(v, (*at, k))
    return found


def _substituted(value: Any, path: tuple, new: Any) -> Any:
    out = copy.deepcopy(value)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = new
    return out


def _variants(valid: Any, nullable: set[str]) -> list[tuple[tuple, Any, bool]]:
    """(path, substitute, whether it must be refused): one of another JSON type than the value it replaces
    must be; one of the same type may be valid (run_id "x") or not (a digest "x"): it must then not crash."""
    out = []
    for path, old in _paths(valid):
        for new in SUBSTITUTES:
            same = type(new) is type(old) or (new is None and str(path[-1]) in nullable) \
                or (old is None and isinstance(new, str))  # (a text field left empty: str or null)
            out.append((path, new, not same))
    return out


def _ids(variants):
    return [f"{'.'.join(map(str, p))}={json.dumps(n)}" for p, n, _ in variants]


# --- lineage: a sidecar, a checkpoint's metadata, lineage.json --------------------------------------------


def _registered(tmp_path: Path) -> dict[str, Any]:
    """An exported artifact as torchcls leaves it: runs/x/checkpoints/m.onnx with a sidecar pinning its record,
    runs/x/lineage.json pinning the run record, and the log holding both records."""
    run = tmp_path / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    artifact = run / "checkpoints" / "m.onnx"
    artifact.write_bytes(b"not a model: only its lineage is read")
    log = AuditLog(tmp_path / "runs" / "_governance" / "audit.jsonl")
    run_rec = log.append("run", {"run_id": "r" * 32, "run_dir": str(run), "artifacts": []})
    art_rec = log.append("artifact", {"artifact_id": "a" * 32, "parent_run_id": "r" * 32, "path": str(artifact),
                                      "sha256": hashlib.sha256(artifact.read_bytes()).hexdigest()})
    lineage = {"run_id": "r" * 32, "artifact_id": "a" * 32, "audit_log": str(log.path), "signer": "s",
               "outputs": {"predictions": True, "embeddings": False},
               "chain_head": {"seq": art_rec["seq"], "hash": art_rec["hash"]},
               "policy": {"name": "p", "file": "/p.toml"}}
    run_lineage = {"run_id": "r" * 32, "audit_log": str(log.path), "outputs": {}, "chain_head": None,
                   "record_seq": run_rec["seq"], "record_hash": run_rec["hash"]}
    sidecar(artifact).write_text(json.dumps(lineage))
    (run / "lineage.json").write_text(json.dumps(run_lineage))
    return {"artifact": artifact, "log": log.path, "lineage": lineage, "run_lineage": run_lineage, "run": run}


def _consumers(artifact: Path, log: Path) -> None:
    """What reads an artifact's sidecar: predict's and serve's checks before loading, and verify (its pins, the
    log search, the anchors). Export's registration reads a checkpoint's: test_..._substituted_in_export."""
    from torchcls.governance.verification import verify
    from torchcls.provenance.sidecars import check_pinned_sha256, outputs_allowed, read_lineage

    read_lineage(artifact)
    outputs_allowed(artifact)
    check_pinned_sha256(artifact, None)
    verify(artifact, audit_log=str(log))


def _refuse_forbidden(artifact: Path) -> None:
    from torchcls.provenance.sidecars import refuse_forbidden_predictions

    try:
        refuse_forbidden_predictions(artifact, "predict")
    except UserError as e:  # the policy's refusal itself is a UserError too; it must name the policy
        assert "refused" in str(e) or "lineage" in str(e)


def test_a_valid_lineage_reads_back_and_verify_confirms_both_pins(tmp_path):
    from torchcls.governance.verification import verify
    from torchcls.provenance.sidecars import outputs_allowed, read_lineage

    made = _registered(tmp_path)
    assert read_lineage(made["artifact"]) == made["lineage"]
    assert outputs_allowed(made["artifact"]) == {"sample_images": True, "embeddings": False, "predictions": True}
    res = verify(made["artifact"], audit_log=str(made["log"]))
    anchors = [c for c in res.checks if c.name == "audit log anchors"][0]
    assert anchors.status == "pass" and "matches" in anchors.detail and "lineage.json" in anchors.detail


@pytest.mark.parametrize(("payload", "field"), [
    ({"outputs": []}, "outputs"),  # outputs_allowed: TypeError 'list' object is not a mapping
    ({"outputs": {"predictions": False}, "policy": "p"}, "policy"),  # policy['name']: TypeError
    ({"outputs": {"predictions": False}, "policy": {"file": "f"}}, "policy.name"),  # KeyError 'name'
    ({"run_id": "r", "chain_head": {"seq": [1], "hash": "0" * 64}}, "chain_head.seq"),  # check_pins: unhashable
    ({"audit_log": 5}, "audit_log"),
])
def test_the_reviews_sidecars_are_a_user_error_naming_the_field(tmp_path, payload, field):
    from torchcls.provenance.sidecars import outputs_allowed, refuse_forbidden_predictions

    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"junk")
    sidecar(artifact).write_text(json.dumps(payload))
    for use in (outputs_allowed, lambda p: refuse_forbidden_predictions(p, "predict")):
        with pytest.raises(UserError, match=rf"m\.onnx\.lineage\.json: {field}: .*not written by torchcls"):
            use(artifact)


def test_a_checkpoints_lineage_metadata_of_another_type_is_a_user_error(tmp_path):
    import torch
    from safetensors.torch import save_file

    from torchcls.provenance.sidecars import read_lineage

    ckpt = tmp_path / "c.safetensors"
    save_file({"w": torch.zeros(1)}, str(ckpt), metadata={LINEAGE_KEY: json.dumps({"outputs": {"predictions": 1}})})
    with pytest.raises(UserError, match=r"c\.safetensors: torchcls\.lineage: outputs\.predictions: .*bool"):
        read_lineage(ckpt)


@pytest.mark.parametrize("sha256", ["missing", 5, "ABC"])
def test_an_artifact_record_without_a_hex_digest_is_no_record(tmp_path, sha256):
    """registered_sha256 read rec["sha256"] of the sidecar's artifact record: missing, a KeyError; an int, a
    TypeError (want[:16]). The record is now a problem line (records.record_problem), so nothing is registered,
    and verify's chain check names it."""
    from torchcls.provenance.records import record_hash, record_problem
    from torchcls.provenance.sidecars import check_pinned_sha256, registered_sha256

    rec: dict[str, Any] = {"seq": 0, "prev": "0" * 64, "kind": "artifact", "time": "t", "artifact_id": "a"}
    if sha256 != "missing":
        rec["sha256"] = sha256
    rec["hash"] = record_hash(rec)
    assert record_problem(rec) == "record seq 0: an artifact record whose 'sha256' is not a SHA-256 hex digest"
    (tmp_path / "log.jsonl").write_text(json.dumps(rec) + "\n")
    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"junk")
    sidecar(artifact).write_text(json.dumps({"audit_log": str(tmp_path / "log.jsonl"), "artifact_id": "a"}))
    assert registered_sha256(artifact) is None
    check_pinned_sha256(artifact, None)  # nothing registered: the loader decides (no traceback here)
    with pytest.raises(UserError, match="is not one the log's reader takes"):  # and none is written so
        AuditLog(tmp_path / "new.jsonl").append("artifact", {"artifact_id": "a",
                                                             **({} if sha256 == "missing" else {"sha256": sha256})})


def test_a_lineage_json_of_another_type_is_a_failed_pin_not_a_traceback(tmp_path):
    """check_pins looked up `record_seq: []` in a dict: TypeError unhashable. Now the lineage.json is unreadable,
    which is a pin the log does not hold: verify fails its anchors, naming the file."""
    from torchcls.governance.verification import verify

    made = _registered(tmp_path)
    (made["run"] / "lineage.json").write_text(json.dumps({**made["run_lineage"], "record_seq": []}))
    res = verify(made["artifact"], audit_log=str(made["log"]))
    anchors = [c for c in res.checks if c.name == "audit log anchors"][0]
    assert anchors.status == "fail" and "lineage.json pins record seq -1" in anchors.detail


def test_export_of_a_checkpoint_whose_lineage_is_of_another_type_says_so(tmp_path, capsys):
    """register_export ran Path(parent.get("audit_log", "")) with an int: a TypeError after the artifact was built.
    The artifact stays exported, unregistered, and the message says why (as for a lineage the log does not back)."""
    import torch
    from safetensors.torch import save_file

    from torchcls.governance.artifacts import register_export

    ckpt = tmp_path / "c.safetensors"
    save_file({"w": torch.zeros(1)}, str(ckpt), metadata={LINEAGE_KEY: json.dumps({"run_id": "r", "audit_log": 5})})
    artifact = tmp_path / "m.pt2"
    artifact.write_bytes(b"built")
    assert register_export(artifact, ckpt, {"target": "aoti"}) is None
    out = capsys.readouterr().out
    assert "m.pt2 was exported; not registered in the audit log" in out and "audit_log:" in out


LINEAGE_NULLABLE = {"chain_head"}
# The shape _registered writes (placeholder values: the tests substitute into the real one).
SIDECAR_VARIANTS = _variants({
    "run_id": "r", "artifact_id": "a", "audit_log": "l", "signer": "s", "outputs": {"predictions": True},
    "chain_head": {"seq": 1, "hash": "0" * 64}, "policy": {"name": "p", "file": "f"}}, LINEAGE_NULLABLE)


@pytest.mark.parametrize(("path", "new", "refused"), SIDECAR_VARIANTS, ids=_ids(SIDECAR_VARIANTS))
def test_every_field_of_a_sidecar_substituted(tmp_path, path, new, refused):
    made = _registered(tmp_path)
    side = _substituted(made["lineage"], path, new)
    sidecar(made["artifact"]).write_text(json.dumps(side))
    if refused:
        with pytest.raises(UserError, match=rf"m\.onnx\.lineage\.json: {'.'.join(map(str, path))}"):
            _consumers(made["artifact"], made["log"])
    else:
        try:
            _consumers(made["artifact"], made["log"])
        except UserError:
            pass  # e.g. a digest "x": refused too
    _refuse_forbidden(made["artifact"])


RUN_LINEAGE_VARIANTS = _variants({"run_id": "r", "audit_log": "l", "outputs": {}, "chain_head": None,
                                  "record_seq": 0, "record_hash": "0" * 64}, LINEAGE_NULLABLE)


@pytest.mark.parametrize(("path", "new", "refused"), RUN_LINEAGE_VARIANTS, ids=_ids(RUN_LINEAGE_VARIANTS))
def test_every_field_of_a_run_dirs_lineage_json_substituted(tmp_path, path, new, refused):
    """verify reads lineage.json for its pin: a lineage.json of another shape is a failed anchor, never an error."""
    from torchcls.governance.verification import verify

    made = _registered(tmp_path)
    (made["run"] / "lineage.json").write_text(json.dumps(_substituted(made["run_lineage"], path, new)))
    res = verify(made["artifact"], audit_log=str(made["log"]))
    anchors = [c for c in res.checks if c.name == "audit log anchors"][0]
    if refused and path != ("chain_head",):
        assert anchors.status == "fail", anchors.detail


@pytest.mark.parametrize(("path", "new", "refused"), SIDECAR_VARIANTS, ids=_ids(SIDECAR_VARIANTS))
def test_every_field_of_a_checkpoints_lineage_substituted_in_export(tmp_path, path, new, refused, capsys):
    import torch
    from safetensors.torch import save_file

    from torchcls.governance.artifacts import register_export

    made = _registered(tmp_path)
    ckpt = tmp_path / "c.safetensors"
    save_file({"w": torch.zeros(1)}, str(ckpt),
              metadata={LINEAGE_KEY: json.dumps(_substituted(made["lineage"], path, new))})
    artifact = tmp_path / "m.pt2"
    artifact.write_bytes(b"built")
    before = made["log"].read_bytes()
    assert register_export(artifact, ckpt, {"target": "aoti"}) is None  # (no run record lists c.safetensors)
    assert made["log"].read_bytes() == before
    if refused:
        assert f"torchcls.lineage: {'.'.join(map(str, path))}" in capsys.readouterr().out


# --- data manifests: the user's --data-manifest and the store beside the audit log ---------------------------


def _data(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    records = []
    for i in range(2):
        f = root / "a" / f"{i}.png"
        Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(f)  # (verify lists the source's files: readable images)
        records.append({"@id": f"a/{i}.png", "contentUrl": f"a/{i}.png", "sha256": hashlib.sha256(f.read_bytes())
                        .hexdigest(), "contentSize": f.stat().st_size, "label": "a", "tags": ["personal"],
                        "dpv:hasJurisdiction": "EU", "split": "train"})
    return root, records


def _manifest(root: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What build_manifest writes for a CSV source (its fields and their types)."""
    csv = root / "labels.csv"
    csv.write_text("path,label\n" + "".join(f"{r['contentUrl']},{r['label']}\n" for r in records))
    return {"@type": "sc:Dataset", "name": "d", "description": None, "license": "MIT", "url": None,
            "dateCreated": "2026-01-01T00:00:00+00:00", "expires": "2027-01-01", "dpv:hasJurisdiction": "EU",
            "dpv:hasLegalBasis": "consent", "rai:personalSensitiveInformation": ["personal"],
            "rai:dataCollection": None, "tc:source": str(csv), "tc:root": str(root), "tc:recordCount": len(records),
            "distribution": [{"@type": "cr:FileSet", "@id": "files", "name": "files", "includes": "**/*"},
                             {"@type": "cr:FileObject", "@id": "labels.csv", "name": "labels.csv",
                              "contentUrl": str(csv), "encodingFormat": "text/csv",
                              "contentSize": csv.stat().st_size,
                              "sha256": hashlib.sha256(csv.read_bytes()).hexdigest()}],
            "tc:records": records, "tc:merkleRoot": records_root(records)}


def _policy():
    from torchcls.governance.policy import Policy

    return Policy(allowed_regions=["eu-*"], allowed_licenses=["MIT"], allowed_jurisdictions=["EU"],
                  mix_jurisdictions=False, require_legal_basis=True, require_retention=True, max_retention_days=10,
                  residency={"EU": ["eu-*"]}, hooks={"personal": ["strip-exif"]})


def _manifest_consumers(m_bytes: bytes, tmp_path: Path) -> None:
    """Every reader of a manifest: parse (store, verify, lineage --file), load_manifest (--data-manifest), the
    policy's facts and rules, verify's re-hash, the store's reuse and the lineage query."""
    import datetime as dt

    from torchcls.governance.hashcache import HashCache
    from torchcls.governance.integrity import check_data
    from torchcls.governance.manifest import content_key, load_manifest
    from torchcls.governance.policy import facts_of, violations
    from torchcls.governance.query import _manifests_with
    from torchcls.governance.store import store_built

    m = parse_manifest_json(m_bytes, "stored.json")
    violations(_policy(), facts_of(m), "eu-1", set(), today=dt.date(2026, 6, 1))
    check_data(m, cache=HashCache(None))
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    (store / "by-content").mkdir(exist_ok=True)
    (store / "stored.json").write_bytes(m_bytes)
    (store / "by-content" / content_key(m)).write_text("stored")
    store_built(m, store)
    _manifests_with(store, "0" * 64, str(tmp_path / "data" / "a" / "0.png"))
    (tmp_path / "given.json").write_bytes(m_bytes)
    load_manifest(tmp_path / "given.json")


def test_a_valid_manifest_passes_every_reader(tmp_path):
    from torchcls.governance.hashcache import HashCache
    from torchcls.governance.integrity import check_data

    root, records = _data(tmp_path)
    m = _manifest(root, records)
    _manifest_consumers(json.dumps(m).encode(), tmp_path)
    assert check_data(m, cache=HashCache(None)) == []


@pytest.mark.parametrize(("field", "value", "error"), [
    ("tc:root", 5, "tc:root: input should be a valid string"),  # verification.py: Path(5): TypeError
    ("expires", "not-a-date", "expires: value error, not an iso date"),  # policy._retention: ValueError
    ("dateCreated", "2020-13-45", "dateCreated: value error, not an iso date"),
    ("rai:personalSensitiveInformation", "personal", "rai:personalSensitiveInformation: "),
    ("dpv:hasJurisdiction", ["EU"], "dpv:hasJurisdiction: "),  # a set of jurisdictions: unhashable
    ("distribution", ["files"], "distribution.0: "),  # "sha256" not in d: a str, no TypeError but no item
    ("distribution", [{"sha256": "0" * 64}], "distribution.0 has a sha256 but names no file"),
])
def test_the_reviews_manifest_fields_are_a_user_error_naming_the_field(tmp_path, field, value, error):
    root, records = _data(tmp_path)
    m = {**_manifest(root, records), field: value}
    with pytest.raises(UserError, match=rf"^manifest stored\.json: {error}"):
        parse_manifest_json(json.dumps(m).encode(), "stored.json")


@pytest.mark.parametrize(("field", "value"), [("contentUrl", 5), ("contentSize", "7"), ("tags", 3),
                                              ("dpv:hasJurisdiction", ["EU"]), ("sha256", 5)])
def test_a_records_field_of_another_type_is_a_user_error_in_load_manifest_too(tmp_path, field, value):
    """load_manifest (train --data-manifest) checked the tags and the Merkle root, not the types."""
    from torchcls.governance.manifest import load_manifest

    root, records = _data(tmp_path)
    records[1][field] = value
    (tmp_path / "m.json").write_text(json.dumps(_manifest(root, records)))
    with pytest.raises(UserError, match=rf"m\.json: tc:records\.1\.{field}: .*recreate it with `torchcls data"):
        load_manifest(tmp_path / "m.json")


def test_a_non_builtin_record_without_a_file_is_refused(tmp_path):
    root, records = _data(tmp_path)
    m = _manifest(root, records)
    del records[0]["contentUrl"]
    with pytest.raises(UserError, match=r"tc:records\.0 names no file \(contentUrl\)"):
        parse_manifest_json(json.dumps(m).encode(), "m.json")


@pytest.mark.parametrize("variant", ["root", "date"])
def test_verify_of_the_reviews_stored_manifest_fails_that_manifest_without_a_traceback(tmp_path, variant):
    from torchcls.governance.verification import verify

    m = {"tc:records": [], "tc:source": "mnist-5k", "tc:root": ".", "expires": "not-a-date",
         "dateCreated": "2020-01-01", "tc:merkleRoot": records_root([])}
    if variant == "root":
        m["tc:root"] = 5
    artifact, log = stored_run(tmp_path, m)
    res = verify(artifact, audit_log=str(log))
    check = [c for c in res.checks if c.name == "manifest x"][0]
    assert check.status == "fail" and ("tc:root" if variant == "root" else "expires") in check.detail


MANIFEST_NULLABLE = {"description", "license", "url", "name", "expires", "dpv:hasJurisdiction", "dpv:hasLegalBasis",
                     "rai:personalSensitiveInformation", "rai:dataCollection", "label"}


def _shape(tmp_path: Path) -> dict[str, Any]:
    root, records = _data(tmp_path)
    return _manifest(root, records)


MANIFEST_SHAPE = {  # the shape of _manifest (values are placeholders; the test builds the real one)
    "@type": "t", "name": "d", "description": None, "license": "MIT", "url": None, "dateCreated": "2026-01-01",
    "expires": "2027-01-01", "dpv:hasJurisdiction": "EU", "dpv:hasLegalBasis": "consent",
    "rai:personalSensitiveInformation": ["personal"], "rai:dataCollection": None, "tc:source": "s", "tc:root": "r",
    "tc:recordCount": 2, "distribution": [{"@type": "t", "@id": "i", "name": "n", "includes": "**/*"},
                                          {"@type": "t", "@id": "i", "name": "n", "contentUrl": "u",
                                           "encodingFormat": "e", "contentSize": 1, "sha256": "0" * 64}],
    "tc:records": [{"@id": "a", "contentUrl": "a", "sha256": "0" * 64, "contentSize": 1, "label": "a",
                    "tags": ["personal"], "dpv:hasJurisdiction": "EU", "split": "train"}],
    "tc:merkleRoot": "0" * 64}
MANIFEST_VARIANTS = _variants(MANIFEST_SHAPE, MANIFEST_NULLABLE)


@pytest.mark.parametrize(("path", "new", "refused"), MANIFEST_VARIANTS, ids=_ids(MANIFEST_VARIANTS))
def test_every_field_of_a_manifest_substituted(tmp_path, path, new, refused):
    m = _substituted(_shape(tmp_path), path, new)
    if path[0] == "tc:records":  # a record changed: its root follows, as a forger's would
        try:
            m["tc:merkleRoot"] = records_root(m["tc:records"])
        except (TypeError, ValueError, AttributeError):
            pass  # (not a list of records: the schema refuses it before the root is compared)
    data = json.dumps(m).encode()
    if refused:
        with pytest.raises(UserError, match=rf"^manifest stored\.json: {'.'.join(map(str, path))}"):
            _manifest_consumers(data, tmp_path)
    else:
        try:
            _manifest_consumers(data, tmp_path)
        except UserError:
            pass  # a same-typed value may still be refused (a digest "x", a date "x", {} for a record)


def test_verify_of_a_run_record_whose_region_is_not_a_name_fails_its_check(tmp_path):
    """The region of a received run record went to fnmatch against the policy's allowed_regions: TypeError. The run
    record is typed where the log is read (records.RunRecord), so the log's check names the field."""
    from torchcls.governance.verification import verify
    from torchcls.provenance.records import record_hash

    m = {"tc:records": [], "tc:source": "mnist-5k", "tc:root": str(tmp_path), "tc:merkleRoot": records_root([])}
    artifact, log = stored_run(tmp_path, m)
    rec = json.loads(log.read_text().splitlines()[-1])
    rec["region"] = 5
    rec["hash"] = record_hash(rec)
    log.write_text(json.dumps(rec) + "\n")
    (tmp_path / "p.toml").write_text('[processing]\nallowed_regions = ["eu-*"]\n')
    res = verify(artifact, audit_log=str(log), policy=str(tmp_path / "p.toml"))
    check = [c for c in res.checks if c.name == "audit log chain"][0]
    assert check.status == "fail" and "a run record: region: input should be a valid string (got int)" in check.detail
    assert res.status == "failed"

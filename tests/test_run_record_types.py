"""A `run` record read back from the audit log is typed where the log is read (records.RunRecord).

verify, export's registration and `lineage --file` read a run record's run id, run dir, manifests, artifacts,
policy, region and hooks; the log may have come with the artifact, so each value may be of any JSON type. A run
record of another shape is now a problem line of the log, as an artifact record with a bad digest is: verify
fails its checks naming the field, registration refuses the log as not intact, and never another exception.
Each test forges the record as anyone who can write the log can: the value replaced, the chain recomputed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import make_image_folder, tiny_config
from torchcls.errors import UserError
from torchcls.governance.artifacts import UnbackedLineage, backed_parent
from torchcls.governance.policy import Policy
from torchcls.governance.verification import verify
from torchcls.provenance.digest import sha256_file
from torchcls.provenance.lineage import AuditLog, record_hash
from torchcls.provenance.sidecars import read_lineage
from torchcls.training import train

SUBSTITUTES = ([], {}, 1, "x", True, None)
STR, TEXT, LIST, DICT_OR_NONE, INT, ITEM = (str,), (str, type(None)), (list,), (dict, type(None)), (int,), (dict,)
# Every field RunRecord declares (the record's own, then one listed manifest's and artifact's) and the JSON types it
# takes; a substitute of any other type must fail verify. ("hooks", 0): one hook's name.
FIELDS: dict[tuple, tuple[type, ...]] = {
    ("run_id",): STR, ("run_dir",): STR, ("code_version",): STR, ("region",): TEXT, ("policy",): DICT_OR_NONE,
    ("hooks",): LIST, ("hooks", 0): STR, ("manifests",): LIST, ("artifacts",): LIST,
    ("manifests", 0): ITEM, ("manifests", 0, "manifest_sha256"): STR, ("manifests", 0, "merkle_root"): STR,
    ("manifests", 0, "name"): TEXT, ("manifests", 0, "records"): INT, ("manifests", 0, "manifest_hash_version"): INT,
    ("artifacts", 0): ITEM, ("artifacts", 0, "path"): STR, ("artifacts", 0, "sha256"): STR,
    ("artifacts", 0, "artifact_kind"): STR,
}


def _wrong(value: Any, types: tuple[type, ...]) -> bool:
    return not any(type(value) is t for t in types)  # (strict: True is not an int)


VARIANTS = [(path, new) for path in FIELDS for new in SUBSTITUTES]


@pytest.fixture(scope="module")
def governed_run(tmp_path_factory) -> dict[str, Path]:
    """A real governed run (lineage on, unsigned log); its run record then made to carry a policy, a region and a
    hook as torchcls records them, so that verify's policy check reads each."""
    base = tmp_path_factory.mktemp("run-record")
    result = train(tiny_config(make_image_folder(base / "shapes", per_class=4), base / "runs", "r", epochs=1))
    log = base / "runs" / "_governance" / "audit.jsonl"
    _rewrite(log, lambda rec: rec.update(policy=Policy(name="open", allowed_regions=["eu-*"]).to_dict(),
                                         region="eu-1", hooks=["strip-exif"]))
    pinned = result.run_dir / "lineage.json"  # (and its pin moved with it, as the run would have written it)
    run_rec = json.loads(log.read_text().splitlines()[-1])
    pinned.write_text(json.dumps({**json.loads(pinned.read_text()), "record_hash": run_rec["hash"]}))
    return {"base": base, "run": result.run_dir, "log": log}


def _rewrite(log: Path, change) -> None:
    """`change` applied to the last run record, the chain recomputed after it (hashes and links)."""
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    change(next(r for r in reversed(recs) if r["kind"] == "run"))
    prev = "0" * 64
    for rec in recs:
        rec["prev"] = prev
        rec["hash"] = prev = record_hash(rec)
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _forged(governed_run, tmp_path: Path, path: tuple, new: Any) -> tuple[Path, Path]:
    """(the run's best checkpoint, a copy of its log, with manifest store, whose run record holds `new` at `path`)."""
    gov = shutil.copytree(governed_run["log"].parent, tmp_path / "_governance")
    log = gov / "audit.jsonl"

    def change(rec: dict[str, Any]) -> None:
        node = rec
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = new

    _rewrite(log, change)
    return governed_run["run"] / "checkpoints" / "best.safetensors", log


def _failed(res) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in res.checks if c.status == "fail"]


def test_the_run_as_written_verifies(governed_run, tmp_path):
    """The record as torchcls writes it (every field typed, a policy recorded) fails no check; nor with a newer
    torchcls's field added (keys the schema does not name pass): only the run dir's pin of the record's hash then
    differs, as it must for any change."""
    ckpt = governed_run["run"] / "checkpoints" / "best.safetensors"
    res = verify(ckpt, audit_log=str(governed_run["log"]))
    assert not _failed(res), _failed(res)
    assert {"run record", "manifest shapes", "policy (the run's recorded policy)"} <= {c.name for c in res.checks}
    ckpt, log = _forged(governed_run, tmp_path, ("newer_field",), [{"any": ["shape"]}])
    res = verify(ckpt, audit_log=str(log))
    assert [f.split(":")[0] for f in _failed(res)] == ["audit log anchors"], _failed(res)
    assert [c.status for c in res.checks if c.name.startswith(("run record", "manifest", "data", "policy"))] == \
        ["pass"] * 4


@pytest.mark.parametrize(("path", "new"), VARIANTS,
                         ids=[f"{'.'.join(map(str, p))}={json.dumps(n)}" for p, n in VARIANTS])
def test_every_run_record_field_substituted(governed_run, tmp_path, path, new):
    ckpt, log = _forged(governed_run, tmp_path, path, new)
    try:
        res = verify(ckpt, audit_log=str(log))
    except UserError as e:  # the other accepted outcome: refused naming the log
        assert str(log) in str(e)
        return
    if _wrong(new, FIELDS[path]):
        field = ".".join(map(str, path))
        assert res.status == "failed"
        assert any(f"a run record: {field}" in f for f in _failed(res)), _failed(res)


@pytest.mark.parametrize(("path", "new"), [(("artifacts", 0, "sha256"), 1), (("run_id",), ["r"]),
                                           (("manifests", 0), "x"), (("hooks",), None)])
def test_registration_refuses_a_log_whose_run_record_has_another_shape(governed_run, tmp_path, path, new):
    """export's registration backs a checkpoint's lineage with the run record that lists it: a record of another
    shape leaves the log not intact, an UnbackedLineage (a UserError) naming it, not a TypeError."""
    ckpt = governed_run["run"] / "checkpoints" / "best.safetensors"
    lineage = read_lineage(ckpt)
    _, good = _forged(governed_run, tmp_path / "good", ("newer_field",), 1)
    assert backed_parent(AuditLog(good), lineage, sha256_file(ckpt), ckpt)["kind"] == "run"
    _, log = _forged(governed_run, tmp_path / "bad", path, new)
    with pytest.raises(UnbackedLineage, match=rf"{log}, which is not an intact chain .*a run record: "):
        backed_parent(AuditLog(log), lineage, sha256_file(ckpt), ckpt)


@pytest.mark.parametrize(("path", "new"), [(("manifests",), 1), (("manifests", 0), "x"), (("artifacts", 0), "x"),
                                           (("artifacts",), {})])
def test_lineage_of_a_file_reports_a_run_record_of_another_shape(governed_run, tmp_path, path, new):
    """`lineage --file` walks every run record's manifests and artifacts: `m.get` of a str, `{**a}` of a str and
    iterating an int ended it in an AttributeError or TypeError. The record is now one of the log's problems."""
    from torchcls.governance.query import file_lineage

    image = next((governed_run["base"] / "shapes").rglob("*.png"))
    _, good = _forged(governed_run, tmp_path / "good", ("newer_field",), 1)
    assert file_lineage(str(image), good)["runs"]  # (the run that read it, found by its manifest)
    _, log = _forged(governed_run, tmp_path / "bad", path, new)
    found = file_lineage(str(image), log)
    assert not found["runs"] and any(f"a run record: {'.'.join(map(str, path))}" in p
                                     for p in found["audit_log_problems"])


def test_lineage_of_a_file_lists_a_run_record_without_a_run_id(governed_run, tmp_path):
    """run_id is optional in RunRecord (records of older versions): `rec["run_id"]` was a KeyError in lineage --file."""
    from torchcls.governance.query import file_lineage

    image = next((governed_run["base"] / "shapes").rglob("*.png"))
    _, log = _forged(governed_run, tmp_path, ("newer_field",), 1)
    _rewrite(log, lambda rec: rec.pop("run_id"))
    found = file_lineage(str(image), log)
    assert [r["run_id"] for r in found["runs"]] == [None] and not found["audit_log_problems"]


def test_lineage_of_a_file_lists_no_artifact_of_no_run_under_a_run_without_id(governed_run, tmp_path):
    """An artifact record naming no parent run (parent_run_id null) was listed as built from the file when a run
    record without run_id read it: None == None (review 7)."""
    from torchcls.governance.query import file_lineage

    image = next((governed_run["base"] / "shapes").rglob("*.png"))
    _, log = _forged(governed_run, tmp_path, ("newer_field",), 1)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    orphan = {**recs[-1], "kind": "artifact", "seq": recs[-1]["seq"] + 1, "path": "/elsewhere/unrelated.onnx",
              "sha256": "ab" * 32, "parent_run_id": None}
    for key in ("run_id", "manifests", "artifacts", "policy", "region", "hooks", "run_dir", "code_version"):
        orphan.pop(key, None)
    log.write_text(log.read_text() + json.dumps(orphan) + "\n")
    _rewrite(log, lambda rec: rec.pop("run_id"))
    found = file_lineage(str(image), log)
    assert [r["run_id"] for r in found["runs"]] == [None]
    assert "/elsewhere/unrelated.onnx" not in [a["path"] for a in found["artifacts"]]

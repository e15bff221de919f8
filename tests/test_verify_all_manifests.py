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
from torchcls.governance.manifest import MANIFEST_HASH_VERSION, DatasetMeta, build_manifest, manifest_hash
from torchcls.governance.verification import verify
from torchcls.provenance.lineage import AuditLog, manifest_store

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


def _shipped(base: Path, stored: list[dict[str, Any]], **run: Any) -> tuple[Path, Path]:
    """(the artifact, the log): `stored` manifests in the log's store, a run record (`run`) listing the artifact."""
    artifact = base / "ship" / "model.bin"
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(b"weights")
    log = AuditLog(base / "ship" / "_governance" / "audit.jsonl")
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

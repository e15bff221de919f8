"""Review 5, findings 2, 7 and 9: governance readers that still trusted what comes with a received artifact.

- 2: `verify --no-rehash` opened the SQLite hash cache beside the artifact's audit log, which may have come with
  it: another table ended verify in a ValueError, a recursive view ran until memory ran out, a crafted row made a
  changed file "match", and verify deleted or wrote that file. It now trusts only the cache of the user's own runs
  (--out-dir), read through SQLite's read-only mode, its schema checked and its rows bounded and typed.
- 7: a lineage without run_id or audit_log ended export in a KeyError after the artifact was built, and a missing
  run id matched any run record lacking one (None == None). Such a lineage is now unbacked: not registered.
- 9: isolation read a manifest record's optional label; verify walked any folder a received manifest names
  (most of /usr) and ended in an error on a recorded policy of another shape. Both are now failed checks.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from conftest import draw_shape, tiny_config
from received_logs import stored_run
from torchcls.errors import UserError
from torchcls.governance.artifacts import UnbackedLineage, backed_parent, register_artifact, register_export
from torchcls.governance.cli_api import write_manifest
from torchcls.governance.hashcache import CACHE_FILE, HashCache
from torchcls.governance.manifest import DatasetMeta, records_root
from torchcls.governance.verification import verify
from torchcls.provenance.lineage import STORE_DIR, AuditLog
from torchcls.provenance.sidecars import LINEAGE_KEY
from torchcls.training import train

# the hash cache's table as torchcls writes it
TABLE = "CREATE TABLE hashes (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, inode INTEGER, sha256 TEXT)"
POLICY = """[policy]
name = "mine"
[processing]
allowed_regions = ["eu-*"]
[data]
allowed_licenses = ["MIT"]
"""


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[str, Any]:
    """A real governed run of the user's: its out dir holds the audit log, the manifest store and the hash cache."""
    base = tmp_path_factory.mktemp("leftovers")
    data = base / "data"
    data.mkdir()
    rows = []
    for kind in ("circle", "square"):
        for i in range(6):
            draw_shape(kind, 32, seed=i).save(data / f"{kind}_{i}.png")
            rows.append([f"{kind}_{i}.png", kind])
    with (data / "data.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["path", "label"], *rows])
    manifest, _ = write_manifest(str(data / "data.csv"), base / "data.manifest.json",
                                 meta=DatasetMeta(license="MIT", jurisdiction="EU", expires="2099-01-01"))
    (base / "policy.toml").write_text(POLICY)
    cfg = tiny_config(data / "data.csv", base / "runs", "own", epochs=1)
    cfg.data.val_fraction = 0.25
    g = cfg.governance
    g.policy, g.data_manifest, g.region = str(base / "policy.toml"), str(manifest), "eu-west-1"
    run_dir = train(cfg).run_dir
    return {"base": base, "out": base / "runs", "data": data, "ckpt": run_dir / "checkpoints" / "best.safetensors"}


def _received(own: dict[str, Any], tmp_path: Path) -> tuple[Path, Path, Path]:
    """The user's out dir as someone else would ship it: (checkpoint, audit log, the hash cache beside the log)."""
    tree = shutil.copytree(own["out"], tmp_path / "received")
    ckpt = tree / own["ckpt"].relative_to(own["out"])
    return ckpt, tree / STORE_DIR / "audit.jsonl", tree / STORE_DIR / CACHE_FILE


def _cache_with(path: Path, payload: str, row: tuple | None = None) -> Path:
    """A SQLite file as a received tree could carry it (the review's r3 payloads, and the next variants)."""
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    if payload == "cols":
        con.execute("CREATE TABLE hashes (a)")
        con.execute("INSERT INTO hashes VALUES (1)")
    elif payload == "view":  # never ends: each row makes the next
        con.execute("CREATE VIEW hashes AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) "
                    "SELECT 'p'||x, 1, 1, 1, 'd' FROM c")
    else:
        con.execute(TABLE)
        if payload == "trigger":
            con.execute("CREATE TABLE log (x)")
            con.execute("CREATE TRIGGER t AFTER INSERT ON hashes BEGIN INSERT INTO log VALUES (1); END")
        if row is not None:
            con.execute("INSERT INTO hashes VALUES (?, ?, ?, ?, ?)", row)
    con.commit()
    con.close()
    return path


def _check(res, name: str):
    return next(c for c in res.checks if c.name == name)


# --- finding 2: the hash cache verify trusts ---------------------------------------------------------------


@pytest.mark.parametrize("payload", ["cols", "view", "forged-row"])
def test_verify_no_rehash_never_opens_the_cache_beside_a_received_log(own, tmp_path, payload):
    """r3's table of other columns (ValueError) and recursive view (ran out of memory), and the next variant: a
    well-formed cache whose row vouches for a changed data file. None is opened; the file is left as it came."""
    ckpt, log, cache = _received(own, tmp_path)
    data_file = own["data"] / "square_3.png"
    original = data_file.read_bytes()
    try:
        data_file.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # changed: a new mtime, same size
        st = data_file.stat()
        row = (str(data_file.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, hashlib.sha256(original).hexdigest())
        _cache_with(cache, payload, row)
        before = cache.read_bytes()
        res = verify(ckpt, audit_log=str(log), rehash=False, out_dir=own["out"])  # the user's own store
        data = _check(res, "data data")
        assert data.status == "fail" and "square_3.png: content changed" in data.detail
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        with pytest.MonkeyPatch.context() as mp:  # no store named: train's default out dir (./runs), never the
            mp.chdir(elsewhere)                   # received one; none here, so every file is re-read
            res = verify(ckpt, audit_log=str(log), rehash=False)
        assert "square_3.png: content changed" in _check(res, "data data").detail
        assert list(elsewhere.iterdir()) == []  # and no store was made for it
        assert cache.read_bytes() == before and sorted(p.name for p in cache.parent.glob(CACHE_FILE + "*")) == [
            CACHE_FILE]  # neither deleted, nor written, nor given a journal
    finally:
        data_file.write_bytes(original)


@pytest.mark.parametrize("payload", ["cols", "view", "trigger", "text-size", "short-digest"])
def test_a_cache_of_another_shape_is_not_trusted_and_not_touched(tmp_path, payload):
    """Even a named store is read as untrusted: the schema must be the cache's own (no view, no trigger, no other
    column), and each row typed; anything else is ignored (the files are hashed) and left unchanged."""
    f = tmp_path / "data.bin"
    f.write_bytes(b"x")
    st = f.stat()
    rows = {"text-size": (str(f.resolve()), "one", st.st_mtime_ns, st.st_ino, "0" * 64),
            "short-digest": (str(f.resolve()), 1, st.st_mtime_ns, st.st_ino, "d")}
    db = _cache_with(tmp_path / CACHE_FILE, "table" if payload in rows else payload, rows.get(payload))
    before = db.read_bytes()
    started = time.monotonic()
    cache = HashCache(db, read_only=True)
    assert cache.hash_files([f]) == [(hashlib.sha256(b"x").hexdigest(), 1)] and cache.stats()["misses"] == 1
    assert time.monotonic() - started < 10 and db.read_bytes() == before


def test_the_training_cache_rebuilds_a_cache_of_other_columns_instead_of_crashing(tmp_path):
    """The run's own store (writable): r3's `cols` ended in `ValueError: not enough values to unpack`."""
    import os

    f = tmp_path / "data.bin"
    f.write_bytes(b"x")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns - 10**10))  # old enough to be stored
    db = _cache_with(tmp_path / CACHE_FILE, "cols")
    assert HashCache(db).hash_files([f]) == [(hashlib.sha256(b"x").hexdigest(), 1)]
    con = sqlite3.connect(db)
    assert con.execute("SELECT sql FROM sqlite_master WHERE name = 'hashes'").fetchone()[0] == TABLE
    con.close()


def test_the_users_own_cache_serves_verify_and_a_read_only_reader(own):
    """--no-rehash still works on the user's runs: a real run's store serves an unchanged file, and a read-only
    reader (the checks above) does not write it."""
    import os

    f = own["data"] / "circle_2.png"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))  # older than FRESH_NS: the run's cache may store it
    store = own["out"] / STORE_DIR / CACHE_FILE
    HashCache(store).hash_files([f])
    before = store.read_bytes()
    cache = HashCache(store, read_only=True)
    assert cache.hash_files([f]) == [(hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_size)]
    assert cache.stats() == {"hits": 1, "misses": 0} and store.read_bytes() == before
    res = verify(own["ckpt"], rehash=False, out_dir=own["out"])
    assert _check(res, "data data").status == "pass"


# --- finding 7: a lineage that names no run or no log ------------------------------------------------------


def _checkpoint(path: Path, lineage: dict[str, Any]) -> Path:
    save_file({"w": torch.zeros(1)}, str(path), metadata={LINEAGE_KEY: json.dumps(lineage)})
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_review_r1_a_lineage_without_run_id_is_not_backed_by_a_record_without_one(tmp_path, capsys):
    """r1/t.py: lineage {audit_log} and a run record without run_id listing the checkpoint: None == None matched,
    then `parent["run_id"]` raised KeyError after the artifact was built."""
    log = AuditLog(tmp_path / "audit.jsonl")
    ckpt = _checkpoint(tmp_path / "ck.safetensors", {"audit_log": str(log.path)})
    log.append("run", {"artifacts": [{"path": str(ckpt), "sha256": _sha(ckpt)}]})  # no run_id
    before = log.path.read_bytes()
    art = tmp_path / "m.onnx"
    art.write_bytes(b"built")
    assert register_export(art, ckpt, {"target": "onnx"}) is None
    assert "names no run_id" in capsys.readouterr().out
    assert log.path.read_bytes() == before and not list(tmp_path.glob("m.onnx.*"))
    with pytest.raises(UnbackedLineage, match="recorded no such checkpoint"):  # the match itself, asked directly
        backed_parent(log, {"audit_log": str(log.path)}, _sha(ckpt), ckpt)


@pytest.mark.parametrize("lineage", [{"run_id": "r"}, {"run_id": "r", "audit_log": ""},
                                     {"run_id": "", "audit_log": "LOG"}, {"run_id": "r", "audit_log": None}],
                         ids=["no-log", "empty-log", "empty-run", "null-log"])
def test_review_r1_t2_a_lineage_without_its_log_or_run_is_unbacked(tmp_path, lineage):
    """r1/t2.py: through the API, a lineage {run_id} ended in `KeyError: 'audit_log'`; the next variants are empty."""
    log = AuditLog(tmp_path / "audit.jsonl")
    lineage = {k: str(log.path) if v == "LOG" else v for k, v in lineage.items()}
    ckpt = _checkpoint(tmp_path / "ck.safetensors", lineage)
    log.append("run", {"run_id": "", "artifacts": [{"path": str(ckpt), "sha256": _sha(ckpt)}]})
    art = tmp_path / "m.onnx"
    art.write_bytes(b"built")
    try:
        register_artifact(art, ckpt)
    except UnbackedLineage as e:
        assert "names no" in str(e) or "recorded no such checkpoint" in str(e)
    except UserError as e:  # a null audit_log: the lineage schema refuses it where it is read
        assert lineage["audit_log"] is None and "audit_log" in str(e)
    else:
        pytest.fail("registered an artifact under a lineage that names no run or no log")
    assert art.read_bytes() == b"built" and not list(tmp_path.glob("m.onnx.*"))


# --- finding 9: isolation's label, verify's walk and recorded policy --------------------------------------------


def _one_record_manifest(tmp_path: Path, source: str) -> dict[str, Any]:
    (tmp_path / "root").mkdir(exist_ok=True)
    f = tmp_path / "root" / "a.png"
    draw_shape("circle", 8, 0).save(f)
    records = [{"@id": "a.png", "contentUrl": "a.png", "sha256": _sha(f), "contentSize": f.stat().st_size,
                "label": "a"}]
    return {"tc:records": records, "tc:source": source, "tc:root": str(tmp_path / "root"),
            "tc:merkleRoot": records_root(records)}


def test_verify_stops_listing_a_folder_far_larger_than_the_manifest(tmp_path):
    """A received manifest's tc:source named a folder of 1,100 files for its one record (the review: /usr, walked
    for 3.7 s): the walk stops past the record count, as a failed data check."""
    big = tmp_path / "big"
    big.mkdir()
    for i in range(1100):
        (big / f"{i}.png").touch()
    artifact, log = stored_run(tmp_path, _one_record_manifest(tmp_path, str(big)))
    res = verify(artifact, audit_log=str(log))
    data = _check(res, "data x")
    assert data.status == "fail" and "holds more than 1002 files and folders" in data.detail


def test_verify_of_a_manifest_naming_usr_ends_in_a_failed_check_quickly(tmp_path):
    """The review's own case: tc:source /usr."""
    if not Path("/usr").is_dir():
        pytest.skip("no /usr here")
    artifact, log = stored_run(tmp_path, _one_record_manifest(tmp_path, "/usr"))
    started = time.monotonic()
    res = verify(artifact, audit_log=str(log))
    assert time.monotonic() - started < 3 and _check(res, "data x").status == "fail"


def test_a_source_that_cannot_be_listed_is_a_failed_check_not_an_error(tmp_path):
    """The next variant: a small folder the loader refuses (an empty class folder) ended verify in a UserError."""
    src = tmp_path / "folder"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    draw_shape("circle", 8, 0).save(src / "b" / "x.png")
    artifact, log = stored_run(tmp_path, _one_record_manifest(tmp_path, str(src)))
    data = _check(verify(artifact, audit_log=str(log)), "data x")
    assert data.status == "fail" and "could not be listed" in data.detail


@pytest.mark.parametrize("policy", [{"hooks": []}, {"allowed_licenses": "MIT"}, {"trusted_keys": ["x"]},
                                    {"residency": {"EU": 5}}], ids=["hooks-list", "str-list", "key", "residency"])
def test_a_recorded_policy_of_another_shape_fails_the_policy_check(tmp_path, policy):
    """`hooks: []` (the review's) and the next variants ended verify in a UserError from policy_from_dict."""
    m = {"tc:records": [], "tc:source": "mnist-5k", "tc:root": str(tmp_path), "tc:merkleRoot": records_root([])}
    artifact, log = stored_run(tmp_path, m, policy=policy)
    check = _check(verify(artifact, audit_log=str(log)), "policy")
    assert check.status == "fail" and "recorded policy cannot be read" in check.detail and "--policy" in check.detail


@pytest.mark.parametrize("label", ["missing", None, ""])
def test_isolation_refuses_a_record_without_a_label_before_any_copy(own, tmp_path, label):
    """isolate.py read `r["label"]`, which the manifest schema leaves optional: KeyError after every copy was
    written (the review's); a null or empty label (the next variants) failed the CSV loader after them too."""
    from torchcls.governance.hooks import SampleInfo
    from torchcls.governance.isolate import isolate
    from torchcls.governance.manifest import load_manifest

    manifest = load_manifest(own["base"] / "data.manifest.json")
    if label == "missing":
        del manifest["tc:records"][1]["label"]
    else:
        manifest["tc:records"][1]["label"] = label
    infos = [SampleInfo(i, r["@id"], r["sha256"]) for i, r in enumerate(manifest["tc:records"])]
    with pytest.raises(UserError, match=r"record sha256:\w+ \(.+\) has no label.*rebuild the manifest"):
        isolate(manifest, infos, [], tmp_path / "iso", "error")
    assert not (tmp_path / "iso").exists()
    del manifest["tc:records"][1]
    csv_path, bad = isolate(manifest, infos[:1] + infos[2:], [], tmp_path / "iso", "error")  # the labelled rest
    assert not bad and len(list(csv.reader(csv_path.open()))) == len(manifest["tc:records"]) + 1

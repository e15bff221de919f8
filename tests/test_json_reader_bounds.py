"""Every JSON file torchcls reads back is parsed under stated bounds (bounded_json): a crafted file built small
(deep nesting, too many values) is a one-line UserError naming the file, never a RecursionError traceback or
memory in proportion to a parse; the files torchcls itself writes read back as before."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from torchcls.bounded_json import JsonBounds
from torchcls.errors import UserError

DEEP = "[" * 100_000  # past the interpreter's recursion limit: json.loads raised RecursionError


def _manifest(records: list[dict]) -> dict:
    from torchcls.governance.manifest import records_root

    return {"name": "t", "tc:source": "/data", "tc:root": "/data", "tc:records": records,
            "tc:merkleRoot": records_root(records), "rai:personalSensitiveInformation": []}


RECORDS = [{"@id": f"a/{i}.png", "contentUrl": f"a/{i}.png", "sha256": f"{i:064x}", "contentSize": 10, "label": "a"}
           for i in range(3)]


def test_a_manifest_reads_back_and_a_crafted_one_is_refused(tmp_path, monkeypatch):
    from torchcls.governance import manifest as mod

    good = mod.save_manifest(_manifest(RECORDS), tmp_path / "good.json")
    assert mod.load_manifest(good)["tc:records"] == RECORDS
    (tmp_path / "deep.json").write_text(DEEP)
    with pytest.raises(UserError, match="deep.json.*refused"):
        mod.load_manifest(tmp_path / "deep.json")
    monkeypatch.setattr(mod, "MANIFEST_BOUNDS", JsonBounds(max_bytes=1 << 20, max_values=100, max_depth=16,
                                                           max_str=4096))
    (tmp_path / "wide.json").write_text("[" + ",".join(["[]"] * 1000) + "]")
    with pytest.raises(UserError, match="over the bound of 100: refused before parsing"):
        mod.load_manifest(tmp_path / "wide.json")


def test_the_store_and_lineage_query_pass_over_a_crafted_stored_manifest(tmp_path):
    from torchcls.governance.manifest import manifest_hash
    from torchcls.governance.query import _manifests_with
    from torchcls.governance.store import store_built

    m = _manifest(RECORDS)
    store = tmp_path / "store"
    assert store_built(m, store) == m
    stored = store / f"{manifest_hash(m)}.json"
    assert _manifests_with(store, RECORDS[1]["sha256"], None) == {stored.stem: ["a/1.png"]}
    stored.write_text(DEEP)  # replaced by a crafted file: neither a traceback nor a parse of it
    assert _manifests_with(store, RECORDS[1]["sha256"], None) == {}
    assert store_built(m, store) == m


def test_run_dir_records_in_the_report(tmp_path):
    from torchcls.governance.report_section import governance_html
    from torchcls.report.memory_table import memory_section
    from torchcls.report.sections import read_json

    (tmp_path / "eval.json").write_text(json.dumps({"top1": float("nan"), "classes": ["a", "b"]}, indent=2))
    assert read_json(tmp_path / "eval.json")["classes"] == ["a", "b"]
    (tmp_path / "cut.json").write_text('{"top1": 0.')  # a write cut short: no data, as before
    assert read_json(tmp_path / "cut.json") is None
    for name in ("deep.json", "memory.json", "governance.json"):
        (tmp_path / name).write_text(DEEP)
    with pytest.raises(UserError, match="deep.json"):
        read_json(tmp_path / "deep.json")
    with pytest.raises(UserError, match="memory.json"):
        memory_section(tmp_path)
    with pytest.raises(UserError, match="governance.json"):
        governance_html(tmp_path)


def test_memory_timeline(tmp_path):
    from torchcls.memory.cpu_profile import TIMELINE_CATEGORIES, timeline_peak

    rows = [[1, *range(len(TIMELINE_CATEGORIES))], [2, *[5] * len(TIMELINE_CATEGORIES)]]
    (tmp_path / "t.json").write_text(json.dumps([[1, 2], rows]))
    assert timeline_peak(tmp_path / "t.json")["timeline_peak_bytes"] == 5 * len(TIMELINE_CATEGORIES)
    (tmp_path / "t.json").write_text(DEEP)
    with pytest.raises(UserError, match="t.json"):
        timeline_peak(tmp_path / "t.json")
    (tmp_path / "t.json").write_text("[[[[1]]], []]")  # deeper than a timeline's 3 levels
    with pytest.raises(UserError, match="nested deeper than 3"):
        timeline_peak(tmp_path / "t.json")


def test_training_records_read_back_on_resume(tmp_path):
    from torchcls.training.feed import Feed
    from torchcls.training.rundir import CREATED_BY, created_by
    from torchcls.training.thread_tuning import read_record
    from torchcls.training.tracking import _read_tracking_file

    class Loader:
        state = None

        def load_state_dict(self, state, where):  # (the real loader checks `state`: test_resume_state_bounds.py)
            self.state = state

    feed = Feed(kind="shards", train=Loader(), val=None, val_count=0, seed=0)
    (tmp_path / "loader.rank0.json").write_text(json.dumps({"step": 7, "loader": {"epoch": 1, "skipped": []}}))
    feed.load_state(tmp_path, 0, 7)
    assert feed.train.state == {"epoch": 1, "skipped": []}
    (tmp_path / "loader.rank0.json").write_text(DEEP)
    with pytest.raises(UserError, match="loader.rank0.json"):
        feed.load_state(tmp_path, 0, 7)

    (tmp_path / "machine.json").write_text(json.dumps({"torch_threads": 4}))
    assert read_record(tmp_path / "machine.json") == {"torch_threads": 4}
    (tmp_path / "machine.json").write_text(DEEP)
    with pytest.raises(UserError, match="not a JSON machine record"):
        read_record(tmp_path / "machine.json")

    (tmp_path / "tracking.json").write_text(json.dumps({"uri": "file:///m", "experiment_id": "1", "run_id": "r"}))
    assert _read_tracking_file(tmp_path)["run_id"] == "r"
    (tmp_path / "tracking.json").write_text("{")
    assert _read_tracking_file(tmp_path) == {}
    (tmp_path / "tracking.json").write_text(DEEP)
    with pytest.raises(UserError, match="tracking.json"):
        _read_tracking_file(tmp_path)

    (tmp_path / CREATED_BY).write_text(json.dumps({"job": "j"}))
    assert created_by(tmp_path, "j")
    (tmp_path / CREATED_BY).write_text("[" * 4000)
    assert not created_by(tmp_path, "j")


def test_step_choice_record_and_cache(tmp_path, monkeypatch):
    from torchcls.training import step_choice

    monkeypatch.setenv(step_choice.CACHE_ENV, str(tmp_path))
    entry = {"precision": {"requested": "auto", "precision": "fp32", "reason": "r"}, "channels_last": True}
    step_choice.remember("k", entry)
    assert step_choice.cached("k") == entry
    step_choice.cache_path().write_text(DEEP)
    assert step_choice.cached("k") is None  # a damaged cache is measured again
    step_choice.remember("k", entry | {"channels_last": False})
    assert step_choice.cached("k") == entry | {"channels_last": False}
    step_choice.remember("k", {"channels_last": False})  # an entry of another shape: a miss, timed again
    assert step_choice.cached("k") is None
    (tmp_path / "step_choice.json").write_text(DEEP)
    with pytest.raises(UserError, match="step_choice.json"):
        step_choice._choose("fp32", None, None, None, None, (1,), 2, False, tmp_path / "step_choice.json", {})


def test_skip_log_lines_and_fp8_table(tmp_path):
    from torchcls.data.skips import read_skips, record_skip, skip_log_path
    from torchcls.precision.fp8_rule import MeasuredTable

    log = skip_log_path(tmp_path)
    record_skip(log, "a.png", "truncated")
    with open(log, "a") as f:
        f.write("[" * 10_000 + "\n")  # under the line bound, past the nesting json survives
    record_skip(log, "b.png", "not an image")
    assert [r["file"] for r in read_skips(tmp_path)] == ["a.png", "b.png"]

    (tmp_path / "t.json").write_text(DEEP)
    with pytest.raises(UserError, match="not a table written by"):
        MeasuredTable.load(tmp_path / "t.json")


def _safetensors(path: Path, metadata: dict[str, str]) -> Path:
    header = json.dumps({"__metadata__": metadata}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def test_lineage_from_a_checkpoint_header_and_a_sidecar(tmp_path):
    from torchcls.governance.anchors import pins_of
    from torchcls.provenance.sidecars import LINEAGE_KEY, read_lineage, sidecar

    lineage = {"run_id": "r1", "outputs": {"predictions": False}}
    assert read_lineage(_safetensors(tmp_path / "a.safetensors", {LINEAGE_KEY: json.dumps(lineage)})) == lineage
    assert read_lineage(_safetensors(tmp_path / "b.safetensors", {})) is None
    bomb = "[" + ",".join(["[]"] * 20_000) + "]"  # 60 KB: within the header's bounds, not a lineage's
    with pytest.raises(UserError, match="over the bound of 10000"):
        read_lineage(_safetensors(tmp_path / "c.safetensors", {LINEAGE_KEY: bomb}))
    big = _safetensors(tmp_path / "d.safetensors", {LINEAGE_KEY: json.dumps(lineage), "pad": "x" * (9 << 20)})
    assert read_lineage(big) is None  # a header past torchcls's 8 MiB (safetensors itself allows 100 MB): not read
    (tmp_path / "dangling.safetensors").symlink_to(tmp_path / "gone")
    assert read_lineage(tmp_path / "dangling.safetensors") is None  # unreadable: the loader says why
    assert read_lineage(tmp_path / "not-saved-yet.safetensors") is None
    (tmp_path / "e.onnx").write_bytes(b"\x08\x07" * 100)
    assert read_lineage(tmp_path / "e.onnx") is None  # not safetensors

    sidecar(tmp_path / "e.onnx").write_text(json.dumps(lineage))
    assert read_lineage(tmp_path / "e.onnx") == lineage
    sidecar(tmp_path / "e.onnx").write_text(DEEP)
    with pytest.raises(UserError, match="lineage.json"):
        read_lineage(tmp_path / "e.onnx")

    run = tmp_path / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    (run / "lineage.json").write_text(DEEP)
    pins = pins_of(run / "checkpoints" / "last.safetensors", {"run_id": "r1"}, [])
    assert pins == [(str(run / "lineage.json"), {"seq": -1, "hash": "unreadable"})]


def test_attestation_payload_is_parsed_under_bounds(tmp_path):
    from torchcls.provenance import dsse
    from torchcls.provenance.attestation import attestation_path, verify_attestation

    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"x")
    env = {"payloadType": dsse.INTOTO_TYPE, "payload": dsse._b64(DEEP.encode()),
           "signatures": [{"keyid": "k", "sig": dsse._b64(b"s")}]}
    attestation_path(artifact).write_text(json.dumps(env))
    ok, why = verify_attestation(artifact, "0" * 64, {})
    assert ok is False and "not a well-formed signed in-toto statement" in why

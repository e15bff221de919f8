"""Governance integrity: the audit log is signed (HMAC key) and anchored (hashes pinned outside it),
survives a torn append, manifests hash their dateCreated, exports are registered, a policy's
`predictions = false` is honoured, and artifacts are checked against a pinned SHA-256 before loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import make_image_folder, tiny_config
from torchcls.cli import main
from torchcls.errors import UserError
from torchcls.provenance.digest import sha256_file
from torchcls.provenance.lineage import AuditLog, record_hash
from torchcls.training import train

KEY = "0123456789abcdef-test-audit-key"


def recompute_chain(log: Path, drop_seq: int) -> None:
    """What anyone who can write files can do without the key: delete a record and re-link the rest."""
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    out, prev = [], "0" * 64
    for rec in (r for r in recs if r["seq"] != drop_seq):
        rec.update(seq=len(out), prev=prev)
        rec["hash"] = record_hash(rec)
        out.append(json.dumps(rec, sort_keys=True))
        prev = rec["hash"]
    log.write_text("\n".join(out) + "\n")


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory):
    """A run whose audit log is signed with a key kept outside runs/; the log held a record before it."""
    base = tmp_path_factory.mktemp("signed")
    (base / "keys").mkdir()
    (base / "keys" / "audit.key").write_text(KEY + "\n")
    folder = make_image_folder(base / "shapes", per_class=4)
    log = AuditLog(base / "runs" / "_governance" / "audit.jsonl", KEY.encode())
    log.append("note", {"text": "a record from before the run"})
    cfg = tiny_config(folder, base / "runs", "r", epochs=1)
    cfg.governance.audit_key_file = str(base / "keys" / "audit.key")
    result = train(cfg)
    return {"base": base, "run": result.run_dir, "log": log.path, "key": base / "keys" / "audit.key",
            "folder": folder}


def _copy(signed_run, tmp_path) -> tuple[Path, Path]:
    """The runs/ tree copied, so that a test may tamper with it (verify it with --audit-log)."""
    runs = tmp_path / "runs"
    shutil.copytree(signed_run["base"] / "runs", runs)
    return runs / "r" / "checkpoints" / "best.safetensors", runs / "_governance" / "audit.jsonl"


def test_signed_log_verifies_with_its_key(signed_run, capsys):
    ckpt = signed_run["run"] / "checkpoints" / "best.safetensors"
    recs = [json.loads(line) for line in signed_run["log"].read_text().splitlines()]
    assert all(r.get("hmac") and r.get("key_id") for r in recs)
    assert main(["verify", str(ckpt), "--audit-key-file", str(signed_run["key"])]) == 0
    out = capsys.readouterr().out
    assert "PASS  audit log signatures: every record signed" in out and "PASS  audit log anchors" in out
    # No key here: the log is intact, but who wrote it is unproven, and the result says so (exit 3, never PASS).
    assert main(["verify", str(ckpt)]) == 3
    out = capsys.readouterr().out
    assert "SKIP  audit log signatures: HMAC-signed: key id" in out and "--audit-key-file" in out
    assert "UNVERIFIED: " in out and "PASS: " not in out


def test_deleting_a_record_and_recomputing_the_chain_is_caught(signed_run, tmp_path, capsys):
    ckpt, log = _copy(signed_run, tmp_path)
    key, given = signed_run["key"], ["--audit-log", str(log)]
    assert main(["verify", str(ckpt), "--audit-key-file", str(key), *given]) == 0
    capsys.readouterr()
    recompute_chain(log, drop_seq=0)
    assert AuditLog(log).check_chain() == []  # the chain alone is fooled
    assert main(["verify", str(ckpt), "--audit-key-file", str(key), *given]) == 1
    out = capsys.readouterr().out
    assert "FAIL  audit log signatures" in out and "signature does not match" in out
    # Without the key, the hashes pinned in the checkpoint and in lineage.json still catch it.
    assert main(["verify", str(ckpt), *given]) == 1
    out = capsys.readouterr().out
    assert "FAIL  audit log anchors" in out and "rewritten up to that record" in out
    assert "PASS  audit log chain" in out


def _strip_signatures(log: Path, seqs: set[int] | None) -> None:
    """Remove hmac and key_id from the records `seqs` (all when None) and re-link the chain after them."""
    out, prev = [], "0" * 64
    for rec in (json.loads(line) for line in log.read_text().splitlines() if line.strip()):
        if seqs is None or rec["seq"] in seqs:
            rec.pop("hmac", None)
            rec.pop("key_id", None)
        rec["prev"] = prev
        rec["hash"] = prev = record_hash(rec)
        out.append(json.dumps(rec, sort_keys=True))
    log.write_text("\n".join(out) + "\n")


@pytest.mark.parametrize("which", ["newest", "all"])
def test_a_signed_log_that_turns_unsigned_fails_verify_without_the_key(signed_run, tmp_path, capsys, which):
    ckpt, log = _copy(signed_run, tmp_path)
    newest = max(json.loads(line)["seq"] for line in log.read_text().splitlines())
    _strip_signatures(log, {newest} if which == "newest" else None)
    assert AuditLog(log).check_chain() == []
    assert main(["verify", str(ckpt), "--audit-log", str(log)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  audit log signatures" in out
    assert ("unsigned after signed records" if which == "newest" else "no record in it is signed") in out


@pytest.mark.parametrize("where", ["top", "middle", "empty line", "torn end"])
def test_a_line_that_is_not_a_record_fails_verify_with_and_without_the_key(signed_run, tmp_path, capsys, where):
    """Finding 7: a non-JSON line at the top of a signed log passed verify (as an "interrupted append", which
    cannot happen at the top) with and without the key. Only an unterminated last line is a torn append."""
    ckpt, log = _copy(signed_run, tmp_path)
    lines = log.read_text().splitlines()
    if where == "torn end":
        log.write_text("\n".join(lines) + "\n" + '{"seq": 9, "ki')
    else:
        at, junk = (0, "this is not a record") if where == "top" else (1, "{}" if where == "middle" else "")
        log.write_text("\n".join([*lines[:at], junk, *lines[at:]]) + "\n")
    for key in (["--audit-key-file", str(signed_run["key"])], []):
        code = main(["verify", str(ckpt), "--audit-log", str(log), *key])
        out = capsys.readouterr().out
        if where == "torn end":
            assert code == (0 if key else 3) and "an incomplete record" in out and "PASS  audit log chain" in out
        else:
            assert code == 1 and "FAIL  audit log chain: audit log line" in out and "FAIL: " in out


def test_the_key_stays_outside_the_log_and_a_signed_log_takes_no_unsigned_record(signed_run, tmp_path,
                                                                                 monkeypatch):
    cfg = tiny_config(signed_run["folder"], tmp_path / "runs", "x", epochs=1)
    cfg.governance.audit_log = str(signed_run["log"])
    with pytest.raises(UserError, match="is signed .*TORCHCLS_AUDIT_KEY"):
        train(cfg)  # refused at the start, not after training
    assert not (tmp_path / "runs" / "x").exists()
    inside = signed_run["log"].parent / "audit.key"
    inside.write_text(KEY)
    try:
        cfg.governance.audit_key_file = str(inside)
        with pytest.raises(UserError, match="keep the audit key outside"):
            train(cfg)
    finally:
        inside.unlink()
    monkeypatch.setenv("TORCHCLS_AUDIT_KEY", "short")
    cfg.governance.audit_key_file = None
    with pytest.raises(UserError, match="at least 16"):
        train(cfg)


def test_a_torn_last_line_is_reported_and_the_next_append_cuts_it_off(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    for i in range(3):
        log.append("run", {"run_id": f"r{i}"})
    with log.path.open("a") as f:
        f.write('{"seq": 3, "prev": "ab')  # disk full in the middle of a record
    problems = log.check_chain()
    assert [(p.line, p.torn) for p in problems] == [(4, True)]
    rec = log.append("run", {"run_id": "after"})  # crashed with JSONDecodeError before
    assert rec["seq"] == 3 and rec["prev"] == json.loads(log.path.read_text().splitlines()[2])["hash"]
    assert log.check_chain() == []  # the fragment was never a record: cut off, so no junk stays mid-log
    # A complete record that lost only its newline is kept, never dropped.
    text = log.path.read_text()
    log.path.write_text(text.rstrip("\n"))
    rec2 = log.append("run", {"run_id": "next"})
    assert rec2["prev"] == rec["hash"] and rec2["seq"] == 4
    assert log.check_chain() == []
    # An edited line is never a torn one, wherever it is: only an unterminated LAST line is.
    lines = log.path.read_text().splitlines()
    for n, damaged in ((0, lines[0][:-5]), (1, lines[1][:-5]), (4, "not json")):
        log.path.write_text("\n".join([*lines[:n], damaged, *lines[n + 1:]]) + "\n")
        assert (n + 1, False) in [(p.line, p.torn) for p in log.check_chain()]
    log.path.write_text("\n".join(lines) + "\n" + "garbage")  # junk at the end: a torn line (reported)
    with pytest.raises(UserError, match="last line is not a record"):  # ...but junk before it refuses appends
        log.path.write_text("\n".join(lines) + "\nnot a record\n")
        log.append("run", {"run_id": "refused"})


def test_verify_reports_a_torn_line_and_a_changed_date_created(signed_run, tmp_path, capsys):
    ckpt, log = _copy(signed_run, tmp_path)
    with log.open("a") as f:
        f.write('{"seq": 99, "kind": "ru')
    assert main(["verify", str(ckpt), "--audit-key-file", str(signed_run["key"]), "--audit-log", str(log)]) == 0
    assert "an incomplete record" in capsys.readouterr().out
    # dateCreated drives retention (max_retention_days): it is inside the manifest's hash.
    store = log.parent / "manifests"
    stored = next(store.glob("*.json"))
    m = json.loads(stored.read_text())
    m["dateCreated"] = "2098-12-31T00:00:00+00:00"
    stored.write_text(json.dumps(m))
    assert main(["verify", str(ckpt), "--audit-log", str(log)]) == 1
    assert "was modified" in capsys.readouterr().out


def test_a_second_run_on_the_same_data_reuses_the_stored_manifest(signed_run, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(signed_run["base"] / "runs" / "_governance", runs / "_governance")
    cfg = tiny_config(signed_run["folder"], runs, "again", epochs=1)
    cfg.governance.audit_key_file = str(signed_run["key"])
    from torchcls import governance

    before = sorted((runs / "_governance" / "manifests").glob("*.json"))
    gov = governance.begin(cfg, runs / "again")
    assert sorted((runs / "_governance" / "manifests").glob("*.json")) == before
    assert gov.manifest["dateCreated"] == json.loads(before[0].read_text())["dateCreated"]


# --- exports, predictions, pinned digests --------------------------------------------------------------

@pytest.fixture(scope="module")
def no_predictions_run(tmp_path_factory):
    """A governed run whose policy forbids predictions leaving it, and its ONNX export."""
    from torchcls.artifacts.exporter import export
    from torchcls.governance.cli_api import write_manifest
    from torchcls.governance.manifest import DatasetMeta

    base = tmp_path_factory.mktemp("nopred")
    folder = make_image_folder(base / "shapes", per_class=6)
    manifest, _ = write_manifest(str(folder), base / "m.json", meta=DatasetMeta(license="MIT"))
    policy = base / "no-predictions.toml"
    policy.write_text('[policy]\nname = "research-only"\n[outputs]\npredictions = false\n')
    cfg = tiny_config(folder, base / "runs", "np", epochs=1)
    cfg.governance.policy, cfg.governance.data_manifest = str(policy), str(manifest)
    run = train(cfg).run_dir
    exported = export(run, target="onnx", max_batch=4, parity_images=8, min_agreement=0.0)
    return {"run": run, "policy": policy, "onnx": exported.path, "folder": folder,
            "log": base / "runs" / "_governance" / "audit.jsonl"}


@pytest.mark.slow  # an ONNX export
def test_export_is_registered_so_verify_and_lineage_find_it(no_predictions_run, capsys):
    onnx = no_predictions_run["onnx"]
    assert Path(str(onnx) + ".lineage.json").is_file()
    assert main(["verify", str(onnx)]) == 3  # an unsigned log: intact, provenance unproven
    out = capsys.readouterr().out
    assert "PASS  artifact hash" in out and "PASS  audit log anchors" in out and "UNVERIFIED: " in out
    some_file = next((no_predictions_run["folder"] / "circle").glob("*.png"))
    assert main(["lineage", "--file", str(some_file), "--audit-log", str(no_predictions_run["log"]), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert str(onnx.resolve()) in {a["path"] for a in found["artifacts"]}


@pytest.mark.slow  # an ONNX export
def test_predict_and_serve_honour_predictions_false(no_predictions_run, capsys):
    from torchcls.prediction import predict

    image = next((no_predictions_run["folder"] / "circle").glob("*.png"))
    policy = str(no_predictions_run["policy"].resolve())
    for artifact in (no_predictions_run["run"], no_predictions_run["onnx"]):
        with pytest.raises(UserError, match=f"policy 'research-only' \\({policy}\\).*predictions = false"):
            predict(artifact, [image])
    assert main(["serve", str(no_predictions_run["onnx"]), "--port", "0"]) != 0
    assert "predictions = false" in capsys.readouterr().err


@pytest.mark.slow  # an ONNX export
def test_artifacts_are_checked_against_a_pinned_sha256_before_loading(no_predictions_run, signed_run, tmp_path,
                                                                     capsys):
    from torchcls.artifacts.artifact import load_artifact

    src = no_predictions_run["onnx"]
    onnx = tmp_path / "model.onnx"
    shutil.copy(src, onnx)
    shutil.copy(str(src) + ".lineage.json", str(onnx) + ".lineage.json")
    digest = sha256_file(onnx)
    assert load_artifact(onnx, expect_sha256=digest).info.classes == ["circle", "square"]
    with pytest.raises(UserError, match="differs from the expected"):
        load_artifact(onnx, expect_sha256="0" * 64)
    with pytest.raises(UserError, match="not a SHA-256"):
        load_artifact(onnx, expect_sha256="abc")
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 1
    onnx.write_bytes(bytes(data))  # a swapped file: the digest governance registered refuses it
    with pytest.raises(UserError, match="differs from the digest registered in"):
        load_artifact(onnx)
    ckpt = signed_run["run"] / "checkpoints" / "best.safetensors"
    image = next((no_predictions_run["folder"] / "circle").glob("*.png"))
    assert main(["predict", str(ckpt), str(image), "--expect-sha256", sha256_file(ckpt)]) == 0
    assert main(["predict", str(ckpt), str(image), "--expect-sha256", "1" * 64]) != 0
    assert "differs from the expected" in capsys.readouterr().err
    for command in ("predict", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--expect-sha256" in out and "native code" in out


def test_a_resumed_run_keeps_the_stamps_of_its_earlier_attempt(tmp_path):
    """The log moved on between attempts, so the resumed run pins another head; finish rewrites nothing."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from torchcls import governance

    folder = make_image_folder(tmp_path / "shapes", per_class=2)
    run = tmp_path / "runs" / "r"
    first = governance.begin(tiny_config(folder, tmp_path / "runs", "r"), run)
    (run / "checkpoints").mkdir(parents=True)
    last = run / "checkpoints" / "last.safetensors"
    save_file({"w": torch.zeros(2)}, last, metadata=first.checkpoint_metadata())
    first.audit.append("note", {"text": "another run's record"})
    cfg = tiny_config(folder, tmp_path / "runs", "r")
    cfg.run.resume = True
    second = governance.begin(cfg, run)
    assert second.lineage_id == first.lineage_id and second.lineage["chain_head"]["seq"] == 0
    before = last.read_bytes()
    second.finish(SimpleNamespace(steps=0, val_top1=None, written=(last,)))
    assert last.read_bytes() == before

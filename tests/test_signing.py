"""Provenance anyone can verify and only the signer can write (issue 30, finding 7).

Audit records are signed with a private key (Ed25519 or ECDSA P-256) in DSSE envelopes; `verify` needs
only the public key. Every line must be a record (a torn last line aside), with or without a key; a
trusted key or a policy requiring signatures makes an unsigned record, or one under an unknown key,
fail; without a trusted key the result is "unverified" (exit 3), never a PASS. Exports carry a signed
in-toto statement (SLSA provenance) that fails after one byte of the artifact changes.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_image_folder, tiny_config
from torchcls.cli import main
from torchcls.errors import UserError
from torchcls.provenance import dsse
from torchcls.provenance.lineage import AuditLog
from torchcls.provenance.records import MAX_LINE_BYTES, record_hash
from torchcls.provenance.signing import SIGNING_KEY_ENV, TRUSTED_KEYS_ENV, keygen, load_signer


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    mine, attacker = keygen(base / "mine"), keygen(base / "attacker", "ecdsa-p256")
    return {"priv": mine[0], "pub": mine[1], "id": mine[2], "signer": load_signer(mine[0]),
            "evil": load_signer(attacker[0]), "evil_pub": attacker[1]}


def signed_log(path: Path, signer, n: int = 3) -> Path:
    log = AuditLog(path, signer=signer)
    for i in range(n):
        log.append("note", {"text": f"record {i}"})
    return path


def verify_log(capsys, log: Path, *flags: str) -> tuple[int, str]:
    code = main(["governance", "verify-log", str(log), *flags])
    return code, capsys.readouterr().out


def _payload(line: str) -> dict:
    return json.loads(base64.b64decode(json.loads(line)["payload"]))


def _rewrite_unsigned(lines: list[str]) -> list[str]:
    """What anyone who can write the file can do: unwrap every record, drop its signer, re-hash, re-link."""
    out, prev = [], "0" * 64
    for rec in map(_payload, lines):
        rec.pop("signer")
        rec["prev"] = prev
        rec["hash"] = prev = record_hash(rec)
        out.append(json.dumps(rec, sort_keys=True))
    return out


def _change_field(lines: list[str], rehash: bool) -> list[str]:
    rec = _payload(lines[-1])
    rec["text"] = "changed after signing"
    if rehash:  # the chain stays intact: only the signature can tell
        rec["hash"] = record_hash(rec)
    env = json.loads(lines[-1])
    env["payload"] = base64.b64encode(json.dumps(rec).encode()).decode()
    return [*lines[:-1], json.dumps(env)]


def _move_signature(lines: list[str]) -> list[str]:
    a, b = json.loads(lines[1]), json.loads(lines[2])
    a["signatures"] = b["signatures"]
    return [lines[0], json.dumps(a), lines[2]]


TAMPER = {  # name -> lines -> lines
    "junk at the top": lambda ls: ["this is not a record", *ls],
    "junk in the middle": lambda ls: [ls[0], "{not json", *ls[1:]],
    "an empty line": lambda ls: [ls[0], "", *ls[1:]],
    "JSON that is not a record": lambda ls: [*ls[:2], '{"seq": 2}', ls[2]],
    "rewritten unsigned": _rewrite_unsigned,
    "a signature moved to another record": _move_signature,
    "a field changed after signing": lambda ls: _change_field(ls, rehash=False),
    "a field changed and its hash recomputed": lambda ls: _change_field(ls, rehash=True),
    "the front cut off": lambda ls: ls[1:],
}
# Without any key: what only a trusted key can tell is "unverified"; everything else fails.
UNVERIFIED_WITHOUT_KEY = {"rewritten unsigned"}


@pytest.mark.parametrize("tamper", list(TAMPER))
def test_every_tampering_fails_under_the_public_key_or_a_policy_and_never_passes_without(
        keys, tmp_path, capsys, tamper):
    log = signed_log(tmp_path / "audit.jsonl", keys["signer"])
    assert verify_log(capsys, log, "--public-key", str(keys["pub"]))[0] == 0
    log.write_text("\n".join(TAMPER[tamper](log.read_text().splitlines())) + "\n")
    code, out = verify_log(capsys, log, "--public-key", str(keys["pub"]))
    assert code == 1 and out.rstrip().endswith(f"FAIL: {log}"), out
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[provenance]\nrequire_signatures = true\ntrusted_keys = ["{keys["id"]}"]\n')
    assert verify_log(capsys, log, "--policy", str(policy))[0] == 1
    code, out = verify_log(capsys, log)
    assert "PASS: " not in out
    if tamper in UNVERIFIED_WITHOUT_KEY:
        assert code == 3 and "unsigned: 3 records" in out and "signatures not checked" in out and "UNVERIFIED" in out
    else:
        assert code == 1, out


def test_a_record_appended_under_another_key(keys, tmp_path, capsys):
    log = signed_log(tmp_path / "audit.jsonl", keys["signer"])
    AuditLog(log, signer=keys["evil"]).append("note", {"text": "the attacker's own record"})
    code, out = verify_log(capsys, log, "--public-key", str(keys["pub"]))
    assert code == 1 and "line 4: record seq 3 is signed by key sha256:" in out and "not a trusted key" in out
    code, out = verify_log(capsys, log)  # no key: two signers listed, and no claim of provenance
    assert code == 3 and "by 2 signer(s)" in out and "UNVERIFIED" in out and "PASS: " not in out
    code, out = verify_log(capsys, log, "--public-key", str(keys["pub"]), "--public-key", str(keys["evil_pub"]))
    assert code == 0  # both keys trusted: both signers are vouched for


def test_a_policy_can_require_signatures(keys, tmp_path, capsys):
    log = signed_log(tmp_path / "audit.jsonl", keys["signer"])
    trusting = tmp_path / "trusting.toml"
    trusting.write_text(f'[provenance]\nrequire_signatures = true\ntrusted_keys = ["{keys["id"]}"]\n')
    assert verify_log(capsys, log, "--policy", str(trusting))[0] == 0  # the key id alone: public key from the record
    requiring = tmp_path / "requiring.toml"
    requiring.write_text("[provenance]\nrequire_signatures = true\n")
    code, out = verify_log(capsys, log, "--policy", str(requiring))
    assert code == 1 and "requires signatures" in out and "no trusted key was given" in out
    unsigned = AuditLog(tmp_path / "unsigned.jsonl")
    unsigned.append("note", {})
    code, out = verify_log(capsys, unsigned.path, "--policy", str(trusting))
    assert code == 1 and "record seq 0 is not signed" in out
    bad = tmp_path / "bad.toml"
    bad.write_text('[provenance]\ntrusted_keys = ["mykeys.pem"]\n')
    assert main(["governance", "verify-log", str(log), "--policy", str(bad)]) == 2
    assert "[provenance] trusted_keys 'mykeys.pem' is not a key id" in capsys.readouterr().err


def test_a_torn_last_line_is_accepted_and_cut_off_by_the_next_append(keys, tmp_path, capsys):
    log = signed_log(tmp_path / "audit.jsonl", keys["signer"])
    with log.open("a") as f:
        f.write('{"payload": "eyJoYXNoIjo')  # an append stopped by a full disk
    code, out = verify_log(capsys, log, "--public-key", str(keys["pub"]))
    assert code == 0 and "an incomplete record" in out and "reported, not failed" in out
    AuditLog(log, signer=keys["signer"]).append("note", {"text": "after"})
    assert verify_log(capsys, log, "--public-key", str(keys["pub"]))[1].count("incomplete") == 0
    assert len(log.read_text().splitlines()) == 4


def test_a_signed_log_takes_no_unsigned_or_weaker_append(keys, tmp_path):
    log = signed_log(tmp_path / "audit.jsonl", keys["signer"])
    with pytest.raises(UserError, match="signed with a key pair .*TORCHCLS_SIGNING_KEY"):
        AuditLog(log).append("note", {})
    with pytest.raises(UserError, match="signed with a key pair"):
        AuditLog(log, key=b"k" * 32).append("note", {})  # no downgrade to HMAC
    with pytest.raises(UserError, match="more than a line of the audit log may hold"):
        AuditLog(log, signer=keys["signer"]).append("note", {"text": "x" * MAX_LINE_BYTES})


def test_hmac_logs_still_verify_and_a_key_pair_takes_over(keys, tmp_path, capsys):
    """Migration: HMAC records first, key-pair records after; each kind checked by its own key."""
    (tmp_path / "keys").mkdir()
    hmac_key = tmp_path / "keys" / "audit.key"  # (never beside the log)
    hmac_key.write_text("0123456789abcdef-test-audit-key")
    log = AuditLog(tmp_path / "governance" / "audit.jsonl", key=hmac_key.read_bytes())
    log.append("note", {"text": "legacy"})
    code, out = verify_log(capsys, log.path, "--audit-key-file", str(hmac_key))
    assert code == 0 and "HMAC: shows only that a holder of this secret key wrote it" in out
    AuditLog(log.path, key=hmac_key.read_bytes(), signer=keys["signer"]).append("note", {"text": "new"})
    assert verify_log(capsys, log.path, "--audit-key-file", str(hmac_key), "--public-key", str(keys["pub"]))[0] == 0
    code, out = verify_log(capsys, log.path, "--public-key", str(keys["pub"]))
    assert code == 1 and "no HMAC audit key was given" in out


def test_dsse_pae_known_answer_and_round_trip(keys):
    # The example of the DSSE specification (protocol.md).
    assert dsse.pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    env = dsse.sign(dsse.INTOTO_TYPE, b'{"a": 1}', keys["signer"])
    back = dsse.parse(json.loads(json.dumps(env.to_json())))
    assert back == env and back.signatures[0][0] == keys["id"]
    keys["signer"].key.public_key().verify(back.signatures[0][1], dsse.pae(dsse.INTOTO_TYPE, b'{"a": 1}'))
    for bad in ({}, {**env.to_json(), "signatures": []}, {**env.to_json(), "payload": "not base64!"},
                {**env.to_json(), "extra": 1}):
        with pytest.raises(ValueError):
            dsse.parse(bad)


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path):
    private, public, keyid = keygen(tmp_path / "k")
    assert oct(private.stat().st_mode & 0o777) == "0o600" and keyid.startswith("sha256:") and len(keyid) == 71
    with pytest.raises(UserError, match="never overwrites"):
        keygen(tmp_path / "k")
    private.chmod(0o644)
    with pytest.raises(UserError, match="readable by other users"):
        load_signer(private)
    public.chmod(0o600)
    with pytest.raises(UserError, match="not a PEM private key"):
        load_signer(public)


# --- a real run and an export, verified in a fresh process that has only the public key ------------------------

@pytest.fixture(scope="module")
def signed_run(tmp_path_factory):
    """A run and an export signed with a fresh key pair; the private key is deleted before any test runs."""
    from torchcls.governance.artifacts import register_artifact
    from torchcls.training import train

    base = tmp_path_factory.mktemp("signedrun")
    private, public, keyid = keygen(base / "keys")
    cfg = tiny_config(make_image_folder(base / "shapes", per_class=4), base / "runs", "r", epochs=1)
    cfg.governance.signing_key_file = str(private)
    ckpt = train(cfg).run_dir / "checkpoints" / "best.safetensors"
    model = base / "export" / "model.pt2"
    model.parent.mkdir()
    model.write_bytes(b"stands in for an AOTInductor package " * 64)
    register_artifact(model, ckpt, kind="export-aoti", details={"target": "aoti"}, signing_key_file=str(private))
    private.unlink()
    return {"ckpt": ckpt, "model": model, "pub": public, "id": keyid, "log": base / "runs" / "_governance" /
            "audit.jsonl"}


def _fresh(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (SIGNING_KEY_ENV, TRUSTED_KEYS_ENV, "TORCHCLS_AUDIT_KEY")}
    return subprocess.run([sys.executable, "-m", "torchcls", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_a_signed_run_verifies_with_only_the_public_key_in_a_fresh_process(signed_run):
    lines = signed_run["log"].read_text().splitlines()
    assert all(json.loads(line)["payloadType"] == dsse.RECORD_TYPE for line in lines)
    done = _fresh("verify", str(signed_run["ckpt"]), "--public-key", str(signed_run["pub"]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS  audit log signatures: every record signed by a trusted key" in done.stdout
    assert f"PASS: {signed_run['ckpt']} (verified)" in done.stdout
    done = _fresh("verify", str(signed_run["ckpt"]), "--json")
    result = json.loads(done.stdout)
    assert done.returncode == 3 and result["status"] == "unverified" and result["ok"] is False
    assert result["provenance"] == "unproven" and "none was given" in result["unproven_because"]


def test_an_exports_in_toto_statement_names_its_inputs_and_fails_after_one_byte_changes(signed_run, keys, tmp_path):
    from torchcls.provenance.attestation import SLSA_PROVENANCE, STATEMENT_TYPE, attestation_path
    from torchcls.provenance.digest import sha256_file

    model, pub = signed_run["model"], str(signed_run["pub"])
    env = dsse.parse(json.loads(attestation_path(model).read_text()))
    stmt = json.loads(env.payload)
    assert env.payload_type == dsse.INTOTO_TYPE and env.signatures[0][0] == signed_run["id"]
    assert stmt["_type"] == STATEMENT_TYPE and stmt["predicateType"] == SLSA_PROVENANCE
    assert stmt["subject"] == [{"name": "model.pt2", "digest": {"sha256": sha256_file(model)}}]
    deps = stmt["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert deps[0]["digest"]["sha256"] == sha256_file(signed_run["ckpt"])
    assert [d["annotations"]["role"] for d in deps] == ["source-checkpoint", "data-manifest"]
    done = _fresh("governance", "verify-attestation", str(model), "--public-key", pub)
    assert done.returncode == 0 and "signed by trusted key" in done.stdout, done.stdout + done.stderr
    assert _fresh("governance", "verify-attestation", str(model), "--public-key", str(keys["evil_pub"])).returncode == 1
    done = _fresh("verify", str(model), "--public-key", pub)
    assert done.returncode == 0 and "PASS  attestation: in-toto statement signed by trusted key" in done.stdout
    changed = tmp_path / "model.pt2"
    data = bytearray(model.read_bytes())
    data[100] ^= 1
    changed.write_bytes(bytes(data))
    attestation_path(changed).write_bytes(attestation_path(model).read_bytes())
    done = _fresh("governance", "verify-attestation", str(changed), "--public-key", pub)
    assert done.returncode == 1 and "changed after it was signed" in done.stdout


def test_a_pt2_loads_when_a_trusted_public_key_vouches_for_it(signed_run, keys, tmp_path, monkeypatch):
    """trust.decide (no package is loaded here): the attestation, or else the signed registration, counts only
    under a public key the loader trusts (TORCHCLS_TRUSTED_KEYS)."""
    import shutil

    from torchcls.provenance.attestation import attestation_path
    from torchcls.provenance.trust import RECORD_ENV, decide

    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "exports.jsonl"))  # nothing was exported on this machine
    model = signed_run["model"]
    with pytest.raises(UserError, match="refusing to load it.*no audit key is configured"):
        decide(model)
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(keys["evil_pub"]))  # the forger's key proves only the forger signed
    with pytest.raises(UserError, match="refusing to load it"):
        decide(model)
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(signed_run["pub"]))
    assert "in-toto statement signed by trusted key" in decide(model).reason
    bare = tmp_path / "bare" / "model.pt2"  # without its attestation: the registration in the log vouches
    bare.parent.mkdir()
    shutil.copy(model, bare)
    shutil.copy(str(model) + ".lineage.json", str(bare) + ".lineage.json")
    assert not attestation_path(bare).exists()
    assert "signed by trusted key sha256:" in decide(bare).reason


# --- the reader is strict and bounded: any bytes give a result or a UserError ---------------------------------

@functools.cache
def _pool() -> tuple[list[bytes], str]:
    """Real lines of a signed, an HMAC-signed and an unsigned log, and the signer's public key file."""
    base = Path(tempfile.mkdtemp(prefix="torchcls-pool-"))
    private, public, _ = keygen(base / "keys")
    lines = []
    for log in (AuditLog(base / "a.jsonl", signer=load_signer(private)), AuditLog(base / "b.jsonl", key=b"k" * 32),
                AuditLog(base / "c.jsonl")):
        for i in range(3):
            log.append("run", {"run_id": f"r{i}", "artifacts": [{"path": "x", "sha256": "0" * 64}]})
        lines += log.path.read_bytes().splitlines()
    return lines, str(public)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=16)


@st.composite
def a_line(draw) -> bytes:
    real = draw(st.sampled_from(_pool()[0]))
    kind = draw(st.sampled_from(["real", "bytes", "json", "field", "cut", "envelope"]))
    if kind == "real":
        return real
    if kind == "bytes":
        return draw(st.binary(max_size=120)).replace(b"\n", b" ")
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    if kind == "cut":
        return real[:draw(st.integers(0, len(real)))]
    obj = json.loads(real)
    target = json.loads(base64.b64decode(obj["payload"])) if "payload" in obj else obj
    target[draw(st.sampled_from([*target, "signer", "key_id"]))] = draw(JSON)
    if "payload" in obj:
        obj["payload"] = base64.b64encode(json.dumps(target).encode()).decode()
    if kind == "envelope" and "signatures" in obj:
        obj["signatures"] = draw(JSON)
    return json.dumps(obj).encode()


@settings(max_examples=150, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(a_line(), max_size=8), end=st.sampled_from([b"", b"\n"]), keyed=st.booleans())
def test_the_log_reader_returns_a_result_or_a_user_error_for_any_lines(lines, end, keyed):
    from torchcls.governance.logcheck import verify_log

    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "audit.jsonl"
        log.write_bytes(b"\n".join(lines) + end)
        start = time.monotonic()
        try:
            res = verify_log(log, public_keys=[_pool()[1]] if keyed else None)
        except UserError:
            return
        assert res.status in ("verified", "unverified", "failed")
        assert time.monotonic() - start < 5
        if res.status != "failed":  # nothing but records (and at most a torn end) got through
            entries = list(AuditLog(log).entries())
            assert all(e.record is not None or (e.torn and e is entries[-1]) for e in entries)


def test_hostile_lines_are_refused_as_lines(tmp_path, capsys):
    """Nesting deeper than the recursion limit, a 5000-digit number, NaN, bytes that are not UTF-8."""
    log = tmp_path / "audit.jsonl"
    for line in (b"[" * 200_000, b"9" * 5000, b'{"seq": NaN}', b"\xff\xfe{}", b'{"payloadType": 1}'):
        log.write_bytes(line + b"\n")
        code, out = verify_log(capsys, log)
        assert code == 1 and "FAIL  audit log chain: audit log line 1:" in out


def test_a_1_gib_line_is_read_in_bounded_pieces(keys, tmp_path, capsys):
    """A sparse 1 GiB line, then a real record: read MAX_LINE_BYTES at a time, reported, never held whole."""
    log = signed_log(tmp_path / "audit.jsonl", keys["signer"], n=1)
    record = log.read_bytes()
    with log.open("r+b") as f:
        f.truncate(1 << 30)  # 1 GiB of NUL bytes, no newline, costs no disk
        f.seek(0, os.SEEK_END)
        f.write(b"\n" + record)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    code, out = verify_log(capsys, log, "--public-key", str(keys["pub"]))
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert code == 1 and f"a line longer than any record ({MAX_LINE_BYTES} bytes)" in out
    assert grew_mib < 128 and time.monotonic() - start < 120, (grew_mib, time.monotonic() - start)
    with pytest.raises(UserError, match="last line is longer than any record"):  # no append goes on after it
        log.write_bytes(b"x" * (3 * MAX_LINE_BYTES) + b"\n")
        AuditLog(log, signer=keys["signer"]).append("note", {})


def test_a_policy_requiring_signatures_refuses_an_unsigned_run_before_it_starts(keys, tmp_path):
    from torchcls import governance
    from torchcls.governance.cli_api import write_manifest
    from torchcls.governance.manifest import DatasetMeta

    folder = make_image_folder(tmp_path / "shapes", per_class=2)
    manifest, _ = write_manifest(str(folder), tmp_path / "m.json", meta=DatasetMeta(license="MIT"))
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[provenance]\nrequire_signatures = true\ntrusted_keys = ["{keys["id"]}"]\n')
    cfg = tiny_config(folder, tmp_path / "runs", "r")
    cfg.governance.policy, cfg.governance.data_manifest = str(policy), str(manifest)
    with pytest.raises(UserError, match="requires signed audit records .*--signing-key-file"):
        governance.begin(cfg, tmp_path / "runs" / "r")
    other = keygen(tmp_path / "other")[0]
    cfg.governance.signing_key_file = str(other)
    with pytest.raises(UserError, match="is not one of them"):
        governance.begin(cfg, tmp_path / "runs" / "r")
    cfg.governance.signing_key_file = str(keys["priv"])
    gov = governance.begin(cfg, tmp_path / "runs" / "r")
    assert gov.lineage["signer"] == keys["id"]


def test_the_record_count_is_bounded(keys, tmp_path, capsys, monkeypatch):
    from torchcls.provenance import records

    log = signed_log(tmp_path / "audit.jsonl", keys["signer"], n=4)
    monkeypatch.setattr(records, "MAX_RECORDS", 3)
    code, out = verify_log(capsys, log, "--public-key", str(keys["pub"]))
    assert code == 1 and "more than 3 lines, the most torchcls reads" in out


def test_a_users_key_signs_an_export_only_under_a_run_record_that_key_signed(tmp_path):
    """A received run dir can ship its own audit log whose run record lists the received checkpoint: export
    appends to that log (it is the sender's), but the user's key does not sign an export whose run record it
    did not sign."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from torchcls.governance.artifacts import register_artifact
    from torchcls.provenance.sidecars import LINEAGE_KEY

    private, _, _ = keygen(tmp_path / "keys")
    log = tmp_path / "recv" / "_governance" / "audit.jsonl"
    ckpt = tmp_path / "recv" / "x" / "checkpoints" / "best.safetensors"
    ckpt.parent.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, str(ckpt), metadata={LINEAGE_KEY: json.dumps({"run_id": "a" * 32,
                                                                                   "audit_log": str(log)})})
    listed = {"run_id": "a" * 32, "artifacts": [{"path": str(ckpt), "sha256": hashlib.sha256(ckpt.read_bytes())
                                                 .hexdigest(), "artifact_kind": "checkpoint"}]}
    AuditLog(log).append("run", listed)  # the sender's, unsigned
    model = tmp_path / "model.pt2"
    model.write_bytes(b"built from the received checkpoint")
    with pytest.raises(UserError, match="is not signed by the key that would sign this export"):
        register_artifact(model, ckpt, signing_key_file=str(private))
    assert not (tmp_path / "model.pt2.intoto.jsonl").exists()
    audit_key = tmp_path / "keys" / "audit.key"
    audit_key.write_text("k" * 64)  # the legacy HMAC key: the same rule
    with pytest.raises(UserError, match="is not signed by the audit key that would sign this export"):
        register_artifact(model, ckpt, key_file=str(audit_key))
    register_artifact(model, ckpt)  # unsigned: recorded in the sender's own log, as the sender's
    AuditLog(log, signer=load_signer(private)).append("run", listed)  # a run record this key signed
    register_artifact(model, ckpt, signing_key_file=str(private))
    assert (tmp_path / "model.pt2.intoto.jsonl").exists()

"""A .pt2 is native code: it loads only after a trust decision (torchcls.provenance.trust).

The hostile package here is real: an exported .pt2 whose shared library is replaced by one with a
constructor that creates a marker file, which is what runs when AOTInductor loads a package. Every
refusal is checked by the marker staying absent; `--trust-artifact` is checked by it appearing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from torchcls.artifacts import load_artifact
from torchcls.errors import UserError
from torchcls.provenance.digest import sha256_bytes, sha256_file
from torchcls.provenance.keys import KEY_ENV
from torchcls.provenance.lineage import AuditLog, record_hash
from torchcls.provenance.trust import RECORD_ENV

pytestmark = pytest.mark.slow
MARKER_ENV = "TORCHCLS_TEST_MARKER"
CONSTRUCTOR = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void ran(void) {
    const char *p = getenv("TORCHCLS_TEST_MARKER");
    FILE *f = p ? fopen(p, "w") : NULL;
    if (f) fclose(f);
}
"""


@pytest.fixture(scope="module")
def hostile_pt2(aoti_export, tmp_path_factory) -> Path:
    """The exported package with every shared library in it replaced by one that has a constructor."""
    d = tmp_path_factory.mktemp("hostile")
    (d / "ran.c").write_text(CONSTRUCTOR)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(d / "ran.so"), str(d / "ran.c")], check=True)
    out = d / "model.pt2"
    with zipfile.ZipFile(aoti_export.path) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            zout.writestr(item, (d / "ran.so").read_bytes() if item.filename.endswith(".so") else zin.read(item))
    return out


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "code-ran"
    monkeypatch.setenv(MARKER_ENV, str(path))
    return path


@pytest.fixture
def no_exports_here(tmp_path, monkeypatch) -> None:
    """A machine that exported nothing: only the other ways of trusting a file are left."""
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "exports.jsonl"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchcls", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def test_own_export_loads_with_no_flag(aoti_export) -> None:
    art = load_artifact(aoti_export.path)
    assert "published by torchcls export on this machine" in art.trust


def test_a_package_nothing_vouches_for_is_refused_in_predict_serve_and_load_artifact(
        hostile_pt2, marker, trained_run, tmp_path) -> None:
    image = next((trained_run.parent.parent / "shapes" / "circle").glob("*.png"))
    with pytest.raises(UserError, match=r"refusing to load it: a \.pt2 is native code") as e:
        load_artifact(hostile_pt2)
    assert "--expect-sha256" in str(e.value) and "--trust-artifact" in str(e.value) and KEY_ENV in str(e.value)
    for args in (["predict", str(hostile_pt2), str(image)], ["serve", str(hostile_pt2), "--port", "0"]):
        done = _cli(*args)
        assert done.returncode != 0 and "refusing to load it" in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        assert not marker.exists(), f"torchcls {args[0]} ran the package's code"
    # The payload is real, and the opt-in is what the user asked for: the constructor runs.
    done = _cli("predict", str(hostile_pt2), str(image), "--trust-artifact")
    assert marker.exists() and "not a loadable AOTInductor package" in done.stderr


def test_expect_sha256_pins_the_file(aoti_export, tmp_path, no_exports_here) -> None:
    copy = tmp_path / "received.pt2"
    shutil.copyfile(aoti_export.path, copy)
    with pytest.raises(UserError, match="refusing to load it"):
        load_artifact(copy)
    art = load_artifact(copy, expect_sha256=sha256_file(aoti_export.path))
    assert art.trust == "its SHA-256 matches --expect-sha256"
    with pytest.raises(UserError, match="differs from --expect-sha256"):
        load_artifact(copy, expect_sha256="0" * 64)


def _registered_copy(src: Path, d: Path, key: bytes | None) -> tuple[Path, AuditLog]:
    """`src` copied into `d` with a sidecar and an audit log that registers it, as register_artifact does."""
    d.mkdir()
    path = d / "model.pt2"
    shutil.copyfile(src, path)
    log = AuditLog(d / "audit.jsonl", key)
    log.append("run", {"run_id": "r1"})
    rec = log.append("artifact", {"artifact_id": "a1", "parent_run_id": "r1", "path": str(path),
                                  "sha256": sha256_file(path)})
    (d / "model.pt2.lineage.json").write_text(json.dumps(
        {"run_id": "r1", "artifact_id": "a1", "audit_log": str(log.path),
         "chain_head": {"seq": rec["seq"], "hash": rec["hash"]}}))
    return path, log


def _forge(log: AuditLog, sidecar: Path, digest: str, relink: bool) -> None:
    """What the finding did: the artifact record's sha256 edited and its own hash recomputed; with
    `relink`, the sidecar's pin is rewritten too (a forger who controls every file, but has no key)."""
    lines = log.path.read_text().splitlines()
    rec = json.loads(lines[-1])
    rec["sha256"] = digest
    rec.pop("hmac", None)
    rec["hash"] = record_hash(rec)
    log.path.write_text("\n".join(lines[:-1] + [json.dumps(rec)]) + "\n")
    if relink:
        side = json.loads(sidecar.read_text())
        side["chain_head"]["hash"] = rec["hash"]
        sidecar.write_text(json.dumps(side))


@pytest.mark.parametrize("relink", [False, True])
def test_a_forged_registration_is_refused(hostile_pt2, aoti_export, marker, tmp_path, monkeypatch,
                                          no_exports_here, relink) -> None:
    key = b"k" * 32
    for signed in (False, True):
        if signed:
            monkeypatch.setenv(KEY_ENV, key.decode())
        path, log = _registered_copy(aoti_export.path, tmp_path / f"signed{signed}", key if signed else None)
        shutil.copyfile(hostile_pt2, path)
        _forge(log, path.with_name(path.name + ".lineage.json"), sha256_file(path), relink)
        with pytest.raises(UserError, match="refusing to load it"):
            load_artifact(path)
        assert not marker.exists()


def test_a_registration_under_the_configured_key_is_trusted(aoti_export, tmp_path, monkeypatch,
                                                            no_exports_here) -> None:
    key = b"k" * 32
    path, _ = _registered_copy(aoti_export.path, tmp_path / "unsigned", None)
    with pytest.raises(UserError, match="no audit key is configured"):  # a keyless registration vouches for nothing
        load_artifact(path)
    monkeypatch.setenv(KEY_ENV, key.decode())
    path, _ = _registered_copy(aoti_export.path, tmp_path / "signed", key)
    assert "signed with the configured audit key" in load_artifact(path).trust
    monkeypatch.setenv(KEY_ENV, "another key of 32 bytes, not it!")
    with pytest.raises(UserError, match="does not verify"):
        load_artifact(path)


def test_a_pt2_that_is_not_a_regular_file_is_refused_before_any_loader(tmp_path) -> None:
    """A device (or FIFO) named .pt2 used to skip the trust decision and go to AOTInductor's loader."""
    from torchcls.provenance.trust import decide

    device = tmp_path / "model.pt2"
    device.symlink_to("/dev/null")
    with pytest.raises(UserError, match=r"model\.pt2: a \.pt2 artifact must be a regular file"):
        load_artifact(device)
    fifo = tmp_path / "fifo.pt2"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="must be a regular file"):  # (hashing it would wait for a writer forever)
        decide(fifo)


def _sidecar_naming(tmp_path: Path, log_text: bytes) -> Path:
    path = tmp_path / "model.pt2"
    path.write_bytes(b"not a package")
    (tmp_path / "audit.jsonl").write_bytes(log_text)
    (tmp_path / "model.pt2.lineage.json").write_text(json.dumps(
        {"artifact_id": "a1", "audit_log": str(tmp_path / "audit.jsonl"), "chain_head": {"seq": 0, "hash": "x"}}))
    return path


def test_the_audit_log_a_sidecar_names_is_read_only_under_a_key_and_line_by_bounded_line(
        tmp_path, monkeypatch, no_exports_here) -> None:
    """The sidecar comes with the file and names any file as its audit log: a huge one-line file was read
    whole (memory) before the missing key was noticed. Now no key: the log is not opened; a key: a line
    longer than any record is refused from a bounded read, before the log is parsed."""
    from torchcls.provenance import trust

    def not_read(self):
        raise AssertionError(f"{self.path} was parsed")

    monkeypatch.setattr(AuditLog, "records", not_read)
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = _sidecar_naming(tmp_path, b"[" * (3 << 20))
    with pytest.raises(UserError, match="names the audit log .* but no audit key is configured"):
        trust.decide(path)
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    with pytest.raises(UserError, match=rf"line 2 of its audit log .* longer than any record \({trust.MAX_LINE} bytes"):
        trust.decide(_sidecar_naming(tmp_path, b"{}\n" + b"[" * (3 << 20)))


def test_export_publishes_the_digest_taken_right_after_the_build(tmp_path, monkeypatch) -> None:
    """The digest that `export` records (and registers) is the built file's, taken before the file is loaded
    back (a .pt2 is native code); a file that changed after its build is not published."""
    from torchcls.artifacts import exporter

    built = b"the package as built"
    record = tmp_path / "exports.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))

    class Plan:
        label = "fp32"

        def build(self, ep, info, tmp, extra):
            Path(tmp).write_bytes(built)
            return {}

    class Target:
        def load(self, tmp, device):
            with open(tmp, "ab") as f:  # what loading native code could do to the file
                f.write(b" and then changed")
            return "loaded"

    tmp, out = tmp_path / ".model.partial.pt2", tmp_path / "model.pt2"
    info = type("Info", (), {"target": "aoti"})()
    report, artifact, digest = exporter._build_and_load(Plan(), Target(), None, info, tmp, {}, "cpu")
    assert artifact == "loaded" and digest == sha256_bytes(built)
    with pytest.raises(UserError, match="changed between its build and its publication"):
        exporter._publish(tmp, out, digest)
    assert not out.exists() and not record.exists()
    tmp.write_bytes(built)
    exporter._publish(tmp, out, digest)
    assert json.loads(record.read_text())["sha256"] == digest == sha256_file(out)


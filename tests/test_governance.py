"""Data governance: manifests, policy refusals before any data is read, hooks, redaction of
restricted samples in every output, the hash-chained audit log, verify and lineage."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from PIL.ExifTags import GPS, IFD

from conftest import draw_shape, tiny_config
from torchcls.cli import main
from torchcls.errors import UserError
from torchcls.governance import hook
from torchcls.governance.cli_api import write_manifest
from torchcls.governance.manifest import DatasetMeta, build_manifest, load_manifest
from torchcls.governance.policy import load_policy
from torchcls.provenance.lineage import AuditLog
from torchcls.training import train

MAGENTA = (250, 10, 240)  # only the restricted images have this colour (shapes: G >= 150, backgrounds < 80)
SECRET = "secret_patient"
SEEN = {"n": 0}

UNVERIFIED = 3  # `verify` found nothing wrong, but without a trusted key provenance is unproven


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@hook("count-samples", "tensor")
def count_samples(x, info):
    SEEN["n"] += 1
    return x


def gps_jpeg(path: Path, color=MAGENTA) -> Path:
    exif = Image.Exif()
    exif[0x0110] = "TestCam"
    exif.get_ifd(IFD.GPSInfo)[GPS.GPSLatitudeRef] = "N"
    exif.get_ifd(IFD.GPSInfo)[GPS.GPSLatitude] = (52.0, 31.0, 12.0)
    Image.new("RGB", (32, 32), color).save(path, exif=exif)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A CSV data set: public shapes, and restricted 'personal' magenta images (one with GPS EXIF,
    one unreadable) that must never leave a governed run."""
    root = tmp_path_factory.mktemp("govdata")
    rows = []
    for kind in ("circle", "square"):
        for i in range(8):
            draw_shape(kind, 32, seed=i).save(root / f"{kind}_{i}.png")
            rows.append([f"{kind}_{i}.png", kind, "", "EU"])
    for i in range(3):
        Image.new("RGB", (32, 32), MAGENTA).save(root / f"{SECRET}_{i}.png")
        rows.append([f"{SECRET}_{i}.png", "square", "personal", "EU"])
    gps_jpeg(root / f"{SECRET}_gps.jpg")
    (root / f"{SECRET}_broken.png").write_bytes(b"")
    rows += [[f"{SECRET}_gps.jpg", "square", "personal;geolocation", "EU"],
             [f"{SECRET}_broken.png", "circle", "personal", "EU"]]
    with (root / "data.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["path", "label", "tags", "jurisdiction"], *rows])
    return root


def manifest_for(dataset: Path, out: Path, **meta) -> Path:
    fields = dict(license="CC-BY-4.0", jurisdiction="EU", legal_basis="consent", expires="2099-01-01") | meta
    path, _ = write_manifest(str(dataset / "data.csv"), out, meta=DatasetMeta(**fields))
    return path


def policy_file(path: Path, extra: str = "") -> Path:
    path.write_text(f"""[policy]
name = "eu-personal"
[processing]
allowed_regions = ["eu-*"]
[data]
allowed_licenses = ["CC-BY-4.0", "MIT"]
allowed_jurisdictions = ["EU"]
mix_jurisdictions = false
require_legal_basis = true
require_retention = true
[residency]
EU = ["eu-*"]
[hooks]
personal = ["strip-exif", "redact-samples"]
geolocation = ["strip-exif"]
{extra}""")
    return path


def governed_cfg(dataset: Path, out: Path, name: str, policy: Path, manifest: Path, hooks: str):
    cfg = tiny_config(dataset / "data.csv", out, name, epochs=1)
    cfg.data.on_bad_file, cfg.data.val_fraction = "skip", 0.25
    cfg.train.tensorboard = True
    g = cfg.governance
    g.policy, g.data_manifest, g.region, g.hooks, g.sample_grid = str(policy), str(manifest), "eu-west-1", hooks, 64
    return cfg


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    """A governed run (restricted samples redacted) and a control run whose policy restricts nothing."""
    base = tmp_path_factory.mktemp("govruns")
    manifest = manifest_for(dataset, base / "data.manifest.json")
    SEEN["n"] = 0
    gov = train(governed_cfg(dataset, base / "runs", "governed", policy_file(base / "policy.toml"), manifest,
                             "strip-exif,redact-samples,count-samples"))
    seen = SEEN["n"]
    open_policy = policy_file(base / "open.toml", "[outputs]\nrestricted_tags = []\n").read_text()
    open_policy = open_policy.replace('personal = ["strip-exif", "redact-samples"]', "").replace(
        'geolocation = ["strip-exif"]', "")
    (base / "open.toml").write_text(open_policy)
    ctrl = train(governed_cfg(dataset, base / "runs", "control", base / "open.toml", manifest, ""))
    return {"governed": gov.run_dir, "control": ctrl.run_dir, "base": base, "manifest": manifest, "seen": seen,
            "log": base / "runs" / "_governance" / "audit.jsonl"}


# --- outputs of a run: search them all ---------------------------------------------------------

def _images_in(run_dir: Path) -> list[Image.Image]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ims = [Image.open(p) for p in run_dir.rglob("*.png")]
    for data in re.findall(r'base64,([A-Za-z0-9+/=]+)"', (run_dir / "report.html").read_text()):
        ims.append(Image.open(io.BytesIO(base64.b64decode(data))))
    if (run_dir / "tensorboard").is_dir():
        acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags()["images"]:
            ims += [Image.open(io.BytesIO(e.encoded_image_string)) for e in acc.Images(tag)]
    return ims


def _magenta_pixels(im: Image.Image) -> int:
    px = np.asarray(im.convert("RGB")).astype(int)
    return int(((px[..., 0] > 200) & (px[..., 1] < 70) & (px[..., 2] > 200)).sum())


def _bytes_found(run_dir: Path, needle: bytes) -> list[str]:
    return [str(p) for p in run_dir.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_restricted_samples_never_leave_a_governed_run(runs):
    gov, ctrl = runs["governed"], runs["control"]
    assert runs["seen"] > 0  # the tensor hook saw every sample before the model
    # The control shows what a leak looks like, so the searches below can fail.
    assert sum(_magenta_pixels(im) for im in _images_in(ctrl)) > 0
    assert _bytes_found(ctrl, SECRET.encode())
    ims = _images_in(gov)
    assert len(ims) >= 3  # curves, sample grid (file, report, TensorBoard)
    assert all(_magenta_pixels(im) == 0 for im in ims)
    assert _bytes_found(gov, SECRET.encode()) == []
    summary = json.loads((gov / "governance.json").read_text())
    assert summary["samples"]["redacted"] == 4 and summary["samples"]["shown"] == 16
    assert summary["redacted_file_names"] == 1 and summary["isolated_processing"]
    skipped = json.loads((gov / "skipped_files.json").read_text())["skipped_files"]
    assert len(skipped) == 1 and skipped[0]["file"].startswith("[redacted sample sha256:")
    html = (gov / "report.html").read_text()
    assert "Data governance" in html and "lineage id" in html and "data-section='governance'" not in html


def test_strip_exif_removes_gps(tmp_path):
    from torchcls.governance.hooks import SampleInfo, strip_exif
    from torchcls.governance.isolate import isolate

    src = gps_jpeg(tmp_path / "photo.jpg", color=(10, 200, 30))
    assert Image.open(src).getexif().get_ifd(IFD.GPSInfo)  # the GPS really is there
    clean = strip_exif(Image.open(src), SampleInfo(0, "photo.jpg", None))
    assert not clean.getexif() and "exif" not in clean.info
    out = tmp_path / "clean.jpg"
    clean.save(out)
    assert not Image.open(out).getexif().get_ifd(IFD.GPSInfo) and b"GPS" not in out.read_bytes()
    # The isolated processing path: copies made by the hook, with the same pixels and no EXIF at all.
    (tmp_path / "d.csv").write_text("path,label\nphoto.jpg,a\n")
    m = build_manifest(str(tmp_path / "d.csv"))
    csv_path, bad = isolate(m, [SampleInfo(0, "photo.jpg", m["tc:records"][0]["sha256"])],
                            [strip_exif.torchcls_hook], tmp_path / "iso", "error")
    copy = Path(next(csv.DictReader(csv_path.open()))["path"])
    assert not bad and copy.name.startswith(m["tc:records"][0]["sha256"])
    assert not Image.open(copy).getexif()
    assert np.array_equal(np.asarray(Image.open(copy)), np.asarray(Image.open(src)))


# --- refusal before any data is read ---------------------------------------------------------------

REFUSALS = {
    "license": ({"license": "CC-BY-NC-4.0"}, "", "license 'CC-BY-NC-4.0' is not allowed"),
    "region": ({}, "region:us-east-1", "host region 'us-east-1' is not allowed"),
    "hook": ({}, "hooks:strip-exif", "tag 'personal' requires hook(s) redact-samples"),
    "retention": ({"expires": "2020-01-01"}, "", "retention expired on 2020-01-01"),
    "mixing": ({}, "mix", "mixes data from jurisdictions EU, US"),
    "tampered": ({}, "tamper", "content changed"),
    "no-manifest": ({}, "nomanifest", "no data manifest"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_policy_violation_stops_training_before_data_is_read(case, dataset, tmp_path, monkeypatch):
    import torchcls.training.build as loop

    meta, change, message = REFUSALS[case]
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    if change == "mix":
        with (data / "data.csv").open("a") as f:
            f.write("circle_0.png,circle,,US\n")
    manifest = manifest_for(data, tmp_path / "m.json", **meta)
    if change == "tamper":
        flip_byte(data / "circle_3.png", 40)
    calls = []
    monkeypatch.setattr(loop, "build_data", lambda *a, **k: calls.append(a) or pytest.fail("data was read"))
    cfg = governed_cfg(data, tmp_path / "runs", "refused", policy_file(tmp_path / "p.toml"), manifest,
                       "strip-exif,redact-samples,count-samples")
    if change.startswith("region:"):
        cfg.governance.region = change.split(":")[1]
    if change.startswith("hooks:"):
        cfg.governance.hooks = change.split(":")[1] + ",count-samples"
    if change == "nomanifest":
        cfg.governance.data_manifest = None
    SEEN["n"] = 0
    with pytest.raises(UserError, match=re.escape(message)) as err:
        train(cfg)
    assert "training refused" in str(err.value)
    assert calls == [] and SEEN["n"] == 0
    assert not (tmp_path / "runs" / "refused").exists()  # no metrics, no checkpoint, no report
    log = AuditLog(tmp_path / "runs" / "_governance" / "audit.jsonl")
    refused = [rec for _, rec, _ in log.records() if rec and rec["kind"] == "refused"]
    assert len(refused) == 1 and any(message in r for r in refused[0]["reasons"])


def test_bad_policy_manifest_and_tags_name_what_failed(tmp_path, dataset):
    bad = tmp_path / "bad.toml"
    bad.write_text("[data\nallowed = 1")
    with pytest.raises(UserError, match="does not parse as TOML"):
        load_policy(bad)
    bad.write_text("[data]\nallowed_licences = ['MIT']\n")
    with pytest.raises(UserError, match="unknown key 'allowed_licences' in \\[data\\]"):
        load_policy(bad)
    bad.write_text("[hooks]\npersonnal = ['strip-exif']\n")
    with pytest.raises(UserError, match="unknown sensitivity tag.*'personnal'"):
        load_policy(bad)
    with pytest.raises(UserError, match="unknown sensitivity tag.*'secret'"):
        build_manifest(str(dataset / "data.csv"), meta=DatasetMeta(tags=["secret"]))
    m = manifest_for(dataset, tmp_path / "m.json")
    raw = json.loads(m.read_text())
    raw["tc:records"][2]["label"] = "dog"
    m.write_text(json.dumps(raw))
    with pytest.raises(UserError, match="do not hash to its Merkle root"):
        load_manifest(m)
    with pytest.raises(UserError, match="unknown hook 'strip-gps'"):
        from torchcls.governance.hooks import resolve_hooks
        resolve_hooks("strip-gps")


# --- tamper evidence ---------------------------------------------------------------------------------

def test_audit_log_detects_a_change_to_any_record(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    for i in range(4):
        log.append("run", {"run_id": f"r{i}", "metrics": {"top1": 0.5 + i / 10}})
    assert log.check_chain() == []
    lines = log.path.read_text().splitlines()
    for n in range(len(lines)):
        for edit in (lambda s: s.replace('"top1": 0.', '"top1": 1.'), lambda s: s[:-3] + s[-2:]):
            tampered = lines.copy()
            tampered[n] = edit(tampered[n])
            log.path.write_text("\n".join(tampered) + "\n")
            problems = log.check_chain()
            assert problems and problems[0].line == n + 1, (n, problems)
    for tampered in (lines[:1] + lines[2:], [lines[1], lines[0], *lines[2:]]):  # removed, reordered
        log.path.write_text("\n".join(tampered) + "\n")
        assert log.check_chain()


def test_verify_passes_then_catches_each_tampering(runs, capsys, tmp_path):
    ckpt = runs["governed"] / "checkpoints" / "best.safetensors"
    assert main(["verify", str(ckpt)]) == UNVERIFIED  # intact, but no trusted key was given
    out = capsys.readouterr().out
    assert "UNVERIFIED: " in out and "PASS  data" in out and "PASS  policy" in out
    pristine = ckpt.read_bytes()
    size = len(pristine)
    for offset in (9, size // 3, size - 1):  # header, metadata/tensors, last tensor byte
        flip_byte(ckpt, offset)
        assert main(["verify", str(ckpt)]) == 1
        assert "FAIL  artifact hash" in capsys.readouterr().out
        ckpt.write_bytes(pristine)
    log = runs["log"]
    lines = log.read_text().splitlines()
    for n, line in enumerate(lines):  # any one record changed (a metric, a hash, the region)
        rec = json.loads(line)
        rec["region"] = "us-east-1"
        log.write_text("\n".join([*lines[:n], json.dumps(rec, sort_keys=True), *lines[n + 1:]]) + "\n")
        assert main(["verify", str(ckpt)]) == 1
        assert f"audit log line {n + 1}" in capsys.readouterr().out
    log.write_text("\n".join(lines) + "\n")
    us = policy_file(tmp_path / "us.toml")
    us.write_text(us.read_text().replace('allowed_regions = ["eu-*"]', 'allowed_regions = ["us-*"]'))
    assert main(["verify", str(ckpt), "--policy", str(us)]) == 1
    assert "host region 'eu-west-1' is not allowed" in capsys.readouterr().out
    data_file = Path(load_manifest(runs["manifest"])["tc:root"]) / "square_5.png"
    original = data_file.read_bytes()
    flip_byte(data_file, 50)
    try:
        assert main(["verify", str(ckpt)]) == 1
        assert "square_5.png: content changed" in capsys.readouterr().out
    finally:
        data_file.write_bytes(original)
    assert main(["verify", str(ckpt)]) == UNVERIFIED
    # --no-rehash trusts the hash cache for files whose size, mtime and inode are unchanged; a rewrite
    # that restores the mtime fools it, so verify re-reads every file by default.
    stat = data_file.stat()
    os.utime(data_file, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**10))  # old enough to be cached
    assert main(["verify", str(ckpt), "--no-rehash", "--out-dir", str(runs["base"] / "runs")]) == UNVERIFIED
    stat = data_file.stat()
    flip_byte(data_file, 50)
    os.utime(data_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    try:
        assert main(["verify", str(ckpt), "--no-rehash", "--out-dir", str(runs["base"] / "runs")]) == UNVERIFIED
        assert main(["verify", str(ckpt)]) == 1
        assert "square_5.png: content changed" in capsys.readouterr().out
    finally:
        data_file.write_bytes(original)


def test_lineage_finds_every_artifact_built_from_a_file(runs, dataset, tmp_path, capsys):
    from torchcls.governance.artifacts import register_artifact

    ckpt = runs["governed"] / "checkpoints" / "best.safetensors"
    exported = tmp_path / "model.pt2"
    exported.write_bytes(ckpt.read_bytes()[::-1])  # stands in for an exporter's output
    artifact_id = register_artifact(exported, ckpt, kind="aoti")
    assert main(["verify", str(exported)]) == UNVERIFIED
    capsys.readouterr()
    assert main(["lineage", "--file", str(dataset / f"{SECRET}_gps.jpg"), "--audit-log", str(runs["log"]),
                 "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert {r["run_dir"] for r in found["runs"]} == {str(runs["governed"]), str(runs["control"])}
    paths = {a["path"] for a in found["artifacts"]}
    expected = {str(p) for r in ("governed", "control") for p in (runs[r] / "checkpoints").glob("*")}
    assert paths == expected | {str(exported.resolve())}
    assert any(a.get("artifact_id") == artifact_id for a in found["artifacts"])
    assert main(["lineage", "--file", found["sha256"], "--audit-log", str(runs["log"]), "--json"]) == 0
    by_hash = json.loads(capsys.readouterr().out)
    assert by_hash["artifacts"] == found["artifacts"]
    other = tmp_path / "unrelated.png"
    draw_shape("circle", 32, seed=999).save(other)
    assert main(["lineage", "--file", str(other), "--audit-log", str(runs["log"])]) == 0
    assert "used by 0 run(s)" in capsys.readouterr().out
    flip_byte(exported, 3)
    assert main(["verify", str(exported)]) == 1



def test_a_received_checkpoint_naming_a_run_of_the_users_log_is_not_registered_as_its(runs, tmp_path, capsys):
    """A checkpoint's lineage (its metadata) is a claim: export registers an artifact under the run it names
    only where that run's record lists the checkpoint's very bytes; verify holds an artifact record's
    parent to the same (a record appended by hand, not by export, fails)."""
    import torch
    from safetensors.torch import save_file

    from torchcls.governance.artifacts import register_artifact, register_export
    from torchcls.provenance.lineage import AuditLog
    from torchcls.provenance.sidecars import LINEAGE_KEY, read_lineage

    ckpt = runs["governed"] / "checkpoints" / "best.safetensors"
    lineage = read_lineage(ckpt)
    received = tmp_path / "received.safetensors"
    save_file({"w": torch.zeros(1)}, str(received), metadata={LINEAGE_KEY: json.dumps(lineage)})
    artifact = tmp_path / "model.pt2"
    artifact.write_bytes(b"built from the received weights")
    before = runs["log"].read_bytes()
    assert register_export(artifact, received, {"target": "aoti"}) is None
    assert "which recorded no such checkpoint: its lineage is a claim the log does not back" in capsys.readouterr().out
    with pytest.raises(UserError, match="recorded no such checkpoint"):
        register_artifact(artifact, received)
    assert runs["log"].read_bytes() == before and not (tmp_path / "model.pt2.lineage.json").exists()

    AuditLog(runs["log"]).append("artifact", {  # what the old export wrote: a record naming the run as parent
        "artifact_id": "f" * 32, "parent_run_id": lineage["run_id"], "parent_sha256": "0" * 64,
        "path": str(artifact.resolve()), "sha256": hashlib.sha256(artifact.read_bytes()).hexdigest(),
        "artifact_kind": "export-aoti", "details": {}})
    try:
        assert main(["verify", str(artifact), "--audit-log", str(runs["log"])]) == 1
        assert "was not recorded by run" in capsys.readouterr().out
        exported = tmp_path / "real.pt2"
        exported.write_bytes(b"built from the run's own checkpoint")
        register_artifact(exported, ckpt, kind="aoti")  # the run's own bytes: registered, verified
        capsys.readouterr()
        assert main(["verify", str(exported)]) == UNVERIFIED
        assert "is a checkpoint run" in capsys.readouterr().out
    finally:
        runs["log"].write_bytes(before)

def test_builtin_manifest_hashes_every_sample(tmp_path, capsys):
    import hashlib

    from torchcls.data import open_source

    assert main(["data", "manifest", "mnist-5k", "--out", str(tmp_path / "m.json"), "--jurisdiction", "US"]) == 0
    m = load_manifest(tmp_path / "m.json")
    images = open_source("mnist-5k", None, "train", None, "error").images
    assert m["tc:recordCount"] == 5000 and m["license"] == "CC-BY-SA-3.0" and m["dpv:hasJurisdiction"] == "US"
    for i in (0, 1234, 4999):
        assert m["tc:records"][i]["sha256"] == hashlib.sha256(images[i].numpy().tobytes()).hexdigest()
    assert m["distribution"][0]["sha256"] and m["conformsTo"][0].startswith("http://mlcommons.org/croissant")
    assert main(["data", "manifest", "mnist-5k", "--out", str(tmp_path / "x.json"), "--expires", "soon"]) == 2


def test_a_runs_record_lists_only_the_checkpoints_its_trainer_wrote(tmp_path):
    """A resumed run dir may hold files its trainer never wrote (a received one: checkpoints/zz-planted.safetensors):
    the run's audit record, and so every export registered or signed under it, vouches only for result.written."""
    import types

    import torch
    from safetensors.torch import save_file

    from torchcls.config import Config
    from torchcls.governance.artifacts import UnbackedLineage, backed_parent
    from torchcls.governance.run import Governance
    from torchcls.provenance.digest import sha256_file
    from torchcls.provenance.lineage import AuditLog

    run = tmp_path / "runs" / "recv"
    (run / "checkpoints").mkdir(parents=True)
    written, planted = run / "checkpoints" / "last.safetensors", run / "checkpoints" / "zz-planted.safetensors"
    save_file({"w": torch.ones(2)}, str(written))
    save_file({"w": torch.full((2,), 7.0)}, str(planted))
    planted_bytes = planted.read_bytes()
    log = AuditLog(tmp_path / "runs" / "_governance" / "audit.jsonl")
    cfg = Config()
    lineage = {"run_id": "r" * 32, "audit_log": str(log.path), "outputs": {}, "chain_head": log.head()}
    governed = types.SimpleNamespace(run_path=run, cfg=cfg, run_id="r" * 32, lineage=lineage, audit=log, policy=None)
    result = types.SimpleNamespace(steps=1, val_top1=0.5, written=(written,))
    summary = {"manifest_sha256": "ab" * 32, "merkle_root": "cd" * 32, "name": "data", "records": 0}
    record = Governance._record_run(governed, result, {"manifest": summary, "hooks": []})
    assert [Path(a["path"]).name for a in record["artifacts"]] == ["last.safetensors"]
    assert planted.read_bytes() == planted_bytes  # not stamped as this run's either
    backed_parent(log, {"run_id": "r" * 32}, sha256_file(written), written)
    with pytest.raises(UnbackedLineage, match="recorded no such checkpoint"):
        backed_parent(log, {"run_id": "r" * 32}, sha256_file(planted), planted)

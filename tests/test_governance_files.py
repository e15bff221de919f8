"""Governance hashes exactly the files training reads (data/dataset_files.py), re-reads only changed files
(the hash cache), and knows a run's lineage id from the start."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import draw_shape, make_image_folder, tiny_config
from torchcls import events, governance
from torchcls.data.dataset_files import data_files
from torchcls.errors import UserError
from torchcls.governance.hashcache import HashCache
from torchcls.governance.manifest import build_manifest, save_manifest
from torchcls.provenance.digest import sha256_file
from torchcls.provenance.sidecars import read_lineage

OLD = 1_600_000_000  # a modification time well in the past (2020), so no file counts as freshly written


def age(root: Path, seconds: int = OLD) -> None:
    """Give every file under `root` an old mtime: the cache does not store files written moments ago."""
    for p in [root, *root.rglob("*")]:
        os.utime(p, (seconds, seconds))


def rewrite_same_size(path: Path, mtime: int) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, (mtime, mtime))


def csv_set(root: Path, n: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in ("circle", "square"):
        for i in range(n):
            draw_shape(kind, 32, seed=i).save(root / f"{kind}_{i}.png")
            rows.append([f"{kind}_{i}.png", kind])
    with (root / "data.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["path", "label"], *rows])
    return root / "data.csv"


def test_data_files_are_the_files_training_lists(tmp_path):
    from torchcls.data import open_source

    folder = make_image_folder(tmp_path / "shapes", per_class=3)
    (folder / "circle" / ".hidden.png").write_bytes(b"x")  # hidden: neither trained on nor hashed
    (folder / "square" / "broken.png").write_bytes(b"")  # unreadable: skipped, but a file of the set
    images = open_source(str(folder), None, "train", None, "skip")
    files = data_files(str(folder))
    assert files[:len(images.paths)] == [Path(p) for p in images.paths]
    assert {p.name for p in files} == {f"{c}_{i:03d}.png" for c in ("circle", "square") for i in range(3)} | {
        "broken.png"}
    # A CSV: its relative paths resolve against --root exactly as training resolves them, plus the CSV.
    table = csv_set(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert data_files(str(table))[-1] == table
    assert all(p.parent == tmp_path / "a" for p in data_files(str(table)))
    assert all(p.parent == tmp_path / "b" for p in data_files(str(table), str(tmp_path / "b"))[:-1])
    assert [p.name for p in data_files("mnist-5k")] == ["mnist_5k.csv.gz"]


def test_data_files_cover_every_split(tmp_path):
    """A train/ val/ test/ layout and a CSV split column: the files of every split, each once."""
    for split in ("train", "val", "test"):
        make_image_folder(tmp_path / "layout" / split, per_class=2)
    files = data_files(str(tmp_path / "layout"))
    assert len(files) == len(set(files)) == 12
    assert {p.relative_to(tmp_path / "layout").parts[0] for p in files} == {"train", "val", "test"}
    table = csv_set(tmp_path / "c", n=3)
    rows = table.read_text().splitlines()
    table.write_text("\n".join([rows[0] + ",split"] + [f"{r},{('train', 'val')[i % 2]}" for i, r in
                                                       enumerate(rows[1:])]) + "\n")
    assert sorted(p.name for p in data_files(str(table))[:-1]) == sorted(r.split(",")[0] for r in rows[1:])
    manifest = build_manifest(str(tmp_path / "layout"))
    assert manifest["tc:recordCount"] == 12
    assert {(r["split"], r["label"]) for r in manifest["tc:records"]} == {
        (s, c) for s in ("train", "val", "test") for c in ("circle", "square")}


def test_hash_cache_rereads_only_changed_files(tmp_path):
    make_image_folder(tmp_path / "d", per_class=4)
    age(tmp_path / "d")
    files = sorted((tmp_path / "d").rglob("*.png"))
    cache = HashCache(tmp_path / "cache.sqlite")
    first = cache.hash_files(files)
    assert cache.stats() == {"hits": 0, "misses": 8}
    assert first == [(sha256_file(p), p.stat().st_size) for p in files]
    again = HashCache(tmp_path / "cache.sqlite")  # a new process: the cache is on disk
    assert again.hash_files(files) == first and again.stats() == {"hits": 8, "misses": 0}
    rewrite_same_size(files[3], OLD + 60)  # same size, new content and mtime
    third = HashCache(tmp_path / "cache.sqlite")
    digests = third.hash_files(files)
    assert third.stats() == {"hits": 7, "misses": 1}
    assert digests[3] == (sha256_file(files[3]), files[3].stat().st_size) and digests[3] != first[3]
    # A file written just now is hashed but not cached: its mtime could still hide a same-second rewrite.
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"new")
    for _ in range(2):
        HashCache(tmp_path / "cache.sqlite").hash_files([fresh])
    last = HashCache(tmp_path / "cache.sqlite")
    last.hash_files([fresh])
    assert last.stats() == {"hits": 0, "misses": 1}
    # No cache file (verify's default): every file is read.
    plain = HashCache(None)
    plain.hash_files(files)
    plain.hash_files(files)
    assert plain.stats() == {"hits": 0, "misses": 16}


def test_a_second_run_start_reads_no_unchanged_file(tmp_path):
    folder = make_image_folder(tmp_path / "shapes", per_class=4)
    age(folder)
    cfg = tiny_config(folder, tmp_path / "runs", "r")
    first = governance.begin(cfg, tmp_path / "runs" / "r")
    assert first.hashes.stats() == {"hits": 0, "misses": 8}
    second = governance.begin(cfg, tmp_path / "runs" / "r2")
    assert second.hashes.stats() == {"hits": 8, "misses": 0}
    assert second.manifest["tc:merkleRoot"] == first.manifest["tc:merkleRoot"]
    changed = folder / "square" / "square_002.png"
    rewrite_same_size(changed, OLD + 60)
    third = governance.begin(cfg, tmp_path / "runs" / "r3")
    assert third.hashes.stats() == {"hits": 7, "misses": 1}
    record = next(r for r in third.manifest["tc:records"] if r["@id"] == "square/square_002.png")
    assert record["sha256"] == sha256_file(changed) and third.manifest["tc:merkleRoot"] != first.manifest[
        "tc:merkleRoot"]


def test_manifest_checks_the_files_read_with_the_runs_root(tmp_path):
    table = csv_set(tmp_path / "a")
    manifest = build_manifest(str(table))
    save_manifest(manifest, tmp_path / "m.json")
    assert manifest["distribution"][-1]["sha256"] == sha256_file(table)  # the labels are hashed too
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    rewrite_same_size(tmp_path / "b" / "square_1.png", OLD)
    cfg = tiny_config(table, tmp_path / "runs", "ok")
    cfg.governance.data_manifest = str(tmp_path / "m.json")
    assert governance.begin(cfg, tmp_path / "runs" / "ok").manifest["tc:merkleRoot"] == manifest["tc:merkleRoot"]
    cfg.data.root, cfg.run.name = str(tmp_path / "b"), "other-root"  # same CSV, files read from elsewhere
    with pytest.raises(UserError, match="square_1.png: not in the manifest") as err:
        governance.begin(cfg, tmp_path / "runs" / "other-root")
    assert str(tmp_path / "b") in str(err.value) and "training refused" in str(err.value)
    with (tmp_path / "a" / "data.csv").open("a") as f:  # a label changed in the CSV
        f.write("circle_0.png,square\n")
    cfg.data.root, cfg.run.name = None, "relabelled"
    with pytest.raises(UserError, match="data.csv: content changed"):
        governance.begin(cfg, tmp_path / "runs" / "relabelled")


def test_lineage_id_is_known_at_begin_and_finish_rewrites_no_stamped_checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = make_image_folder(tmp_path / "shapes", per_class=2)
    run = tmp_path / "runs" / "r"
    cfg = tiny_config(folder, tmp_path / "runs", "r")
    gov = governance.begin(cfg, run)
    assert gov.lineage_id and gov.lineage["run_id"] == gov.lineage_id
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, ckpts / "last.safetensors", metadata=gov.checkpoint_metadata())
    save_file({"w": torch.ones(2)}, ckpts / "best.safetensors")  # a trainer that does not stamp
    inode = (ckpts / "last.safetensors").stat().st_ino
    # as the trainer ends a run (result.written: the files it wrote): governance's record, then the report
    written = (ckpts / "best.safetensors", ckpts / "last.safetensors")
    events.publish(events.RunFinished(cfg, run, SimpleNamespace(steps=0, val_top1=None, written=written), True, gov))
    assert (ckpts / "last.safetensors").stat().st_ino == inode  # not rewritten
    assert read_lineage(ckpts / "last.safetensors") == gov.lineage == read_lineage(ckpts / "best.safetensors")
    assert "4 read, 0 unchanged since hashed" in (run / "report.html").read_text()  # new files: all read
    record = json.loads((run / "lineage.json").read_text())
    log = governance.AuditLog(record["audit_log"])
    run_rec = next(r for _, r, _ in log.records() if r and r.get("run_id") == gov.lineage_id)
    assert {Path(a["path"]).name: a["sha256"] for a in run_rec["artifacts"]} == {
        p.name: sha256_file(p) for p in ckpts.glob("*.safetensors")}
    # A resumed run keeps its id, also when it stopped before lineage.json was written.
    (run / "lineage.json").unlink()
    cfg = tiny_config(folder, tmp_path / "runs", "r")
    cfg.run.resume = True
    assert governance.begin(cfg, run).lineage_id == gov.lineage_id


def test_packed_sources_are_hashed_file_by_file(tmp_path):
    """WebDataset shards (with their index) and a local Hugging Face set: one record per packing file."""
    from torchcls.data.shards import write_shards
    from torchcls.governance.integrity import check_data

    folder = make_image_folder(tmp_path / "shapes", per_class=3)
    shards = tmp_path / "shards"
    write_shards(str(folder), shards, 4_000, max_count=2)
    files = data_files(str(shards))
    assert files[-1].name == "index.json" and len(files) >= 3 and all(f.suffix == ".tar" for f in files[:-1])
    manifest = build_manifest(str(shards))
    assert manifest["tc:packed"] and [r["@id"] for r in manifest["tc:records"]] == [f.name for f in files]
    assert check_data(manifest) == []
    cited = manifest["distribution"][-1]["tc:shardIndex"]
    assert cited["num_samples"] == 6 and [s["name"] for s in cited["shards"]] == [f.name for f in files[:-1]]
    rewrite_same_size(files[0], OLD)
    assert check_data(manifest) == [f"{files[0]}: content changed (SHA-256 differs from the manifest)"]
    with pytest.raises(UserError, match=f"records for {files[0].name} differs from the file's"):
        build_manifest(str(shards))  # the index and the shard disagree
    rewrite_same_size(files[0], OLD)  # flip the byte back
    gov = governance.begin(tiny_config(shards, tmp_path / "runs", "s"), tmp_path / "runs" / "s")
    assert gov.manifest["tc:recordCount"] == len(files) and gov.lineage_id
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "hf").mkdir()
    pq.write_table(pa.table({"image": [b"x", b"y"], "label": [0, 1]}), tmp_path / "hf" / "train.parquet")
    hf = build_manifest(f"hf:{tmp_path / 'hf'}")
    assert hf["tc:source"] == f"hf:{tmp_path / 'hf'}" and [r["@id"] for r in hf["tc:records"]] == ["train.parquet"]


def test_val_data_is_hashed_recorded_and_verified(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    from torchcls.cli import main

    train_dir = make_image_folder(tmp_path / "train", per_class=2)
    val_dir = make_image_folder(tmp_path / "val", per_class=1)
    cfg = tiny_config(train_dir, tmp_path / "runs", "r")
    cfg.data.val_data = str(val_dir)
    run = tmp_path / "runs" / "r"
    gov = governance.begin(cfg, run)
    assert gov.val_manifest["tc:recordCount"] == 2 and gov.manifest["tc:recordCount"] == 4
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "best.safetensors"
    save_file({"w": torch.zeros(2)}, ckpt, metadata=gov.checkpoint_metadata())
    summary = gov.finish(SimpleNamespace(steps=0, val_top1=None, written=(ckpt,)))
    assert summary["val_manifest"]["records"] == 2
    assert main(["verify", str(ckpt)]) == 3  # intact; unverified: no trusted key given
    assert capsys.readouterr().out.count("PASS  data") == 2
    rewrite_same_size(val_dir / "circle" / "circle_000.png", OLD)
    assert main(["verify", str(ckpt)]) == 1
    assert "circle_000.png: content changed" in capsys.readouterr().out
    # A policy is checked against --data's manifest only: a separate validation set is refused.
    policy = tmp_path / "policy.toml"
    policy.write_text('[policy]\nname = "p"\n')
    cfg.governance.policy, cfg.run.name = str(policy), "with-policy"
    with pytest.raises(UserError, match="--val-data .*make the validation set the source's val split"):
        governance.begin(cfg, tmp_path / "runs" / "with-policy")


def test_isolated_copies_keep_the_sources_splits(tmp_path):
    from torchcls.data import open_source

    for split, n in (("train", 3), ("val", 1)):
        make_image_folder(tmp_path / "layout" / split, per_class=n)
    cfg = tiny_config(tmp_path / "layout", tmp_path / "runs", "iso")
    cfg.governance.hooks = "strip-exif"
    gov = governance.begin(cfg, tmp_path / "runs" / "iso")
    isolated = gov.data_config.source
    assert isolated != cfg.data.source and gov.data_config.root is None
    rows = list(csv.DictReader(Path(isolated).read_text().splitlines()))
    assert sorted(r["split"] for r in rows) == ["train"] * 6 + ["val"] * 2
    assert len(open_source(isolated, None, "val", None, "error")) == 2
    assert len(open_source(isolated, None, "train", None, "error")) == 6

"""The three feeds of the trainer (map-style files, in-memory cache, streamed shards): a run killed
with SIGKILL mid-epoch and resumed ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_image_folder, tiny_config

# About 42 training images in batches of 8: 5-6 steps an epoch. Killed one step after the step-9
# checkpoint (--save-every 3), mid-way through the second epoch.
KILL_AT = 10


def _config(source: Path, out: Path, name: str, feed: str):
    cfg = tiny_config(source, out, name, epochs=2)
    if feed == "mixup":  # mixup/cutmix draws are keyed by the global step: nothing more to save
        feed, cfg.data.mixup, cfg.data.cutmix = "memory", 0.8, 1.0
    cfg.data.in_memory = "on" if feed == "memory" else "off"
    cfg.data.workers = 0 if feed == "memory" else 1  # a worker process: its RNG and state cross a process edge
    cfg.data.augment = "flip"
    cfg.checkpoint.save_every = 3
    cfg.governance.lineage = False
    return cfg


def _kill_during(cfg, tmp_path: Path) -> None:
    toml = tmp_path / f"{cfg.run.name}.toml"
    cfg.save_toml(toml)
    script = ("import os, signal, sys\nfrom torchcls.config import load_toml\nfrom torchcls.training import train\n"
              f"kill = lambda step: os.kill(os.getpid(), signal.SIGKILL) if step == {KILL_AT} else None\n"
              "train(load_toml(sys.argv[1]), callbacks=[kill])\n")
    r = subprocess.run([sys.executable, "-c", script, str(toml)], capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr[-2000:]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from torchcls.data.shards import write_shards

    base = tmp_path_factory.mktemp("feeds")
    folder = make_image_folder(base / "shapes", per_class=28, size=32)
    shards = base / "shards"
    write_shards(str(folder), shards, 40_000)  # several small shards: whole shards are held out for validation
    return {"files": folder, "memory": folder, "mixup": folder, "shards": shards}


@pytest.mark.slow
@pytest.mark.parametrize("feed", ["files", "memory", "shards", "mixup"])
def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path: Path, sources: dict[str, Path], feed: str) -> None:
    from torchcls.training import train

    full = train(_config(sources[feed], tmp_path, "full", feed))
    cut = _config(sources[feed], tmp_path, "cut", feed)
    _kill_during(cut, tmp_path)
    if feed == "shards":  # the loader's position was saved beside the checkpoint: no replay
        assert (tmp_path / "cut" / "checkpoints" / "loader.rank0.json").is_file()
    cut.run.resume = True
    resumed = train(cut)
    assert resumed.steps == full.steps
    a, b = load_file(full.last_checkpoint), load_file(resumed.last_checkpoint)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_feed_kind_follows_the_data(tmp_path: Path, sources: dict[str, Path]) -> None:
    import json

    from torchcls.training import train

    for feed in ("memory", "shards"):
        cfg = _config(sources[feed], tmp_path, f"kind-{feed}", feed)
        cfg.train.epochs = 1
        result = train(cfg)
        splits = json.loads((result.run_dir / "data_splits.json").read_text())
        assert splits["train"]["images"] + splits["val"]["images"] == 56, splits
        records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["kind"] == "epoch" and "val_top1" in records[-1]


@pytest.mark.parametrize("feed", ["files", "shards"])
def test_loader_workers_end_with_the_run(tmp_path: Path, sources: dict[str, Path], feed: str) -> None:
    """A process that calls train() keeps no loader worker once it returns or raises, with the garbage
    collector off: the workers do not wait for a collection to find the trainer (which then stalled up to 5 s
    per worker), whatever still holds the trainer (here, the traceback of the failed run)."""
    import gc
    import multiprocessing

    from torchcls.training import train

    def stop(step: int) -> None:
        if step == 2:
            raise RuntimeError("stopped by the test")

    assert multiprocessing.active_children() == []
    gc.disable()
    try:
        for name, callbacks in (("returns", []), ("raises", [stop])):
            cfg = _config(sources[feed], tmp_path, f"{name}-{feed}", feed)
            cfg.data.workers = 2
            if callbacks:
                with pytest.raises(RuntimeError, match="stopped by the test"):
                    train(cfg, callbacks=callbacks)
            else:
                assert train(cfg).steps > 0
            assert multiprocessing.active_children() == [], name
    finally:
        gc.enable()


@pytest.mark.slow
@pytest.mark.parametrize("feed", ["shards", "files"])
def test_ddp_with_loader_workers_on_two_ranks(tmp_path: Path, sources: dict[str, Path], feed: str) -> None:
    """Two torchrun ranks, each with a loader worker: streamed shards start new workers every epoch, the
    map-style folder loader once. Under torch.distributed they start from a forkserver (data/worker_start.py),
    which takes every dataset, transform and collate function through pickle."""
    import json
    import os

    # the forkserver binds a socket in TMPDIR, and a socket's path is limited to 107 bytes: a short folder
    tmp = tempfile.mkdtemp(prefix="ddp-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "torchcls",
           "train", "--data", str(sources[feed]), "--out-dir", str(tmp_path), "--name", "ddp", "--parallel", "ddp",
           "--epochs", "2", "--batch-size", "8", "--workers", "1", "--img-size", "32", "--no-progress",
           "--no-lineage", "--dist-timeout", "120", "--in-memory", "off"]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    epochs = [rec for rec in records if rec["kind"] == "epoch"]
    assert len(epochs) == 2 and all(0.0 <= e["val_top1"] <= 1.0 for e in epochs)
    splits = json.loads((tmp_path / "ddp" / "data_splits.json").read_text())
    assert splits["train"]["images"] + splits["val"]["images"] == 56


def test_shards_train_and_validate_on_a_folder(tmp_path: Path, sources: dict[str, Path]) -> None:
    """--val-data takes any source beside shard training: the folder is read map-style and is the
    validation set (all 56 of its images), shards are the training set (all of them, none held out)."""
    import json

    from torchcls.training import train

    cfg = _config(sources["shards"], tmp_path, "val-folder", "shards")
    cfg.train.epochs, cfg.data.val_data = 1, str(sources["files"])
    result = train(cfg)
    splits = json.loads((result.run_dir / "data_splits.json").read_text())
    assert splits["val"] == {"source": str(sources["files"]), "images": 56, "how": "--val-data"}
    assert splits["train"]["images"] == 56  # no shard held out
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "epoch" and "val_top1" in records[-1]

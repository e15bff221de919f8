"""Faults around a run's start: nothing a job did not create is ever deleted, and what a failed start
created is removed so that the same command can simply be run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from torchcls.errors import UserError


def test_a_start_that_fails_before_the_first_step_leaves_no_run_dir(tmp_path: Path, shapes_dir: Path) -> None:
    from torchcls.training import train

    (shapes_dir / "circle" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    cfg = tiny_config(shapes_dir, tmp_path, "again", epochs=1)
    with pytest.raises(UserError, match="broken.png"):
        train(cfg)
    assert not (tmp_path / "again").exists()  # used to stay, and the retry was refused as "already exists"
    (shapes_dir / "circle" / "broken.png").unlink()
    assert train(tiny_config(shapes_dir, tmp_path, "again", epochs=1)).steps > 0


def test_a_users_existing_dir_is_never_removed(tmp_path: Path, shapes_dir: Path) -> None:
    from torchcls.training import train

    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "eval.json").write_text(json.dumps({"top1": 0.9}))
    (shapes_dir / "circle" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(UserError, match="already exists"):
        train(tiny_config(shapes_dir, tmp_path, "keep", epochs=1))
    assert (keep / "eval.json").is_file()


@pytest.mark.slow
def test_an_elastic_restart_keeps_a_dir_it_did_not_create(tmp_path: Path, shapes_dir: Path) -> None:
    """runs/keep holds a user's files; attempt 0 is refused ("already exists"); the restart used to
    delete the dir (it had a config.toml and no checkpoint) and start over."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "config.toml").write_text("[train]\nepochs = 1\n")
    (keep / "eval.json").write_text(json.dumps({"top1": 0.9}))
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "torchcls", "train", "--data", str(shapes_dir), "--out-dir", str(tmp_path), "--name", "keep",
           "--parallel", "ddp", "--epochs", "1", "--batch-size", "8", "--workers", "0", "--img-size", "16",
           "--no-progress", "--no-lineage", "--dist-timeout", "60"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "already exists" in r.stdout + r.stderr
    assert (keep / "eval.json").is_file() and (keep / "config.toml").read_text().startswith("[train]")


NAN_ON_RANK_1 = """
import os, sys, torch
from torchcls.config import Config
from torchcls.training import train
cfg = Config()
cfg.data.source, cfg.data.workers, cfg.data.batch_size, cfg.data.img_size = sys.argv[1], 0, 8, 16
cfg.train.epochs, cfg.train.progress, cfg.governance.lineage = 2, False, False
cfg.precision.nonfinite, cfg.parallel.parallel, cfg.parallel.dist_timeout = "skip", "ddp", 60
cfg.run.out_dir, cfg.run.name = sys.argv[2], "nan"
saved = {}
def poison(step):  # rank 1's weights are NaN for exactly one step (step 6): only its loss is non-finite
    if os.environ["RANK"] != "1" or step not in (5, 6):
        return
    p = next(iter(train_model[0].parameters()))
    with torch.no_grad():
        if step == 5:
            saved["w"] = p.clone(); p.fill_(float("nan"))
        else:
            p.copy_(saved["w"])
train_model = []
import torchcls.training.build as build
real = build.build
def keep(*a, **k):
    t = real(*a, **k); train_model.append(t.model); return t
build.build = keep
train(cfg, callbacks=[poison])
"""


@pytest.mark.slow
def test_a_nan_on_one_rank_is_skipped_by_every_rank(tmp_path: Path, shapes_dir: Path) -> None:
    """Each rank used to decide alone: rank 1 skipped, rank 0 waited in the all-reduce until gloo timed out."""
    script = tmp_path / "nan.py"
    script.write_text(NAN_ON_RANK_1)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(shapes_dir), str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    skipped = [rec for rec in records if rec["kind"] == "nonfinite"]
    assert [rec["step"] for rec in skipped] == [6] and records[-1]["kind"] == "epoch"


def test_a_kill_between_the_two_checkpoint_writes_resumes_one_consistent_step(tmp_path: Path,
                                                                              shapes_dir: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from torchcls.training import train

    full = train(tiny_config(shapes_dir, tmp_path, "full", epochs=3))

    def interrupt(step):
        if step == 6:
            raise KeyboardInterrupt

    cfg = tiny_config(shapes_dir, tmp_path, "cut", epochs=3)
    train(cfg, callbacks=[interrupt])
    ckpt = tmp_path / "cut" / "checkpoints"
    # The next save's weights landed, its training state did not (killed between the two writes).
    with safe_open(str(ckpt / "last.safetensors"), "pt") as f:
        meta = f.metadata()
    newer = {k: v + 1 for k, v in load_file(ckpt / "last.safetensors").items()}
    save_file(newer, str(ckpt / "last.safetensors"), metadata=meta)
    cfg.run.resume = True
    resumed = train(cfg)
    a, b = load_file(full.last_checkpoint), load_file(resumed.last_checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the state's own weights were used, not the newer file

    # A state file from before this change (no weights inside) beside weights of another step: refused.
    state = torch.load(ckpt / "last.state.pt", weights_only=True)
    del state["model"]
    state["step"] -= 1
    torch.save(state, ckpt / "last.state.pt")
    with pytest.raises(UserError, match="stopped between the two writes"):
        train(cfg)


def test_resume_applies_a_new_lr_records_it_and_refuses_another_image_size(tmp_path: Path,
                                                                             shapes_dir: Path) -> None:
    import tomllib

    from torchcls.training import train

    cfg = tiny_config(shapes_dir, tmp_path, "more", epochs=1)
    cfg.optim.warmup_epochs = 0.0
    first = train(cfg)
    cfg.run.resume, cfg.train.epochs, cfg.optim.lr = True, 2, 3e-4
    train(cfg)
    records = [json.loads(line) for line in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    resume = next(r for r in records if r["kind"] == "resume")
    assert resume["changed"]["optim.lr"] == {"before": 3e-3, "now": 3e-4}
    assert resume["changed"]["train.epochs"] == {"before": 1, "now": 2}
    lrs = [r["lr"] for r in records if r["kind"] == "step" and r["step"] > resume["step"]]
    assert lrs and max(lrs) <= 3e-4  # the restored schedule used to keep the old peak of 3e-3
    assert tomllib.loads((first.run_dir / "config.toml").read_text())["optim"]["lr"] == 3e-4
    cfg.data.img_size = 16
    with pytest.raises(UserError, match="--img-size 32 -> 16"):
        train(cfg)
    assert (first.run_dir / "checkpoints" / "last.safetensors").is_file()  # nothing lost

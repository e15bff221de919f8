"""Faults around a run's start: nothing a job did not create is ever deleted, and what a failed start
created is removed so that the same command can simply be run again."""

from __future__ import annotations

import json
import os
import re
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

    from torchcls.checkpoint.files import load_training_state, save_training_state
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
    state = load_training_state(ckpt / "last.state.safetensors")
    del state["model"]
    state["step"] -= 1
    save_training_state(ckpt / "last.state.safetensors", state)
    cfg.train.epochs = 4  # (a run with every epoch done is not resumed at all)
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
    cfg.data.img_size, cfg.train.epochs = 16, 3  # (a run with every epoch done is not resumed at all)
    with pytest.raises(UserError, match="--img-size 32 -> 16"):
        train(cfg)
    assert (first.run_dir / "checkpoints" / "last.safetensors").is_file()  # nothing lost


# -- a run dir that stops taking writes mid-run; a mid-epoch resume's epoch figures ------------------------
# One tiny run, the reference: the faulty runs below resume to exactly its weights and metrics.jsonl.
ARGS = ["--workers", "0", "--batch-size", "8", "--img-size", "32", "--epochs", "2", "--save-every", "2",
        "--threads", "1", "--precision", "fp32", "--no-channels-last", "--no-lineage", "--no-progress"]


def _config(data: Path, out: Path, name: str):
    cfg = tiny_config(data, out, name, epochs=2)
    cfg.checkpoint.save_every, cfg.train.threads, cfg.governance.lineage = 2, 1, False
    cfg.precision.precision, cfg.train.channels_last = "fp32", False  # as ARGS: nothing chosen by timing
    return cfg


def _train(cfg, callbacks=()):
    """train() in this process at one thread (as the reference), leaving the thread count as it was."""
    import torch

    from torchcls.training import train

    threads = torch.get_num_threads()
    try:
        return train(cfg, callbacks=list(callbacks))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import make_image_folder

    base = tmp_path_factory.mktemp("faults")
    data = make_image_folder(base / "shapes")
    run = _train(_config(data, base, "reference")).run_dir
    per_epoch = [r for r in _records(run) if r["kind"] == "epoch"][0]["step"]
    return data, run, per_epoch


def _records(run: Path, drop=("img_per_s", "epoch_s")) -> list[dict]:
    """metrics.jsonl without the timings (the only figures a resumed run cannot share)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in lines]


def _same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a / "checkpoints" / "last.safetensors"), load_file(b / "checkpoints" / "last.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_mid_epoch_resume_logs_the_whole_epochs_figures(reference, tmp_path: Path) -> None:
    """The resumed epoch's train_loss/train_top1 used to cover only the steps after the checkpoint."""
    data, ref, per_epoch = reference

    def interrupt(step):
        if step == per_epoch + 1:  # one step into the second epoch
            raise KeyboardInterrupt

    cfg = _config(data, tmp_path, "split")
    assert _train(cfg, [interrupt]).interrupted
    cfg.run.resume = True
    _train(cfg)
    assert _records(tmp_path / "split") == _records(ref)  # every figure of every record, epochs included
    assert _same_weights(tmp_path / "split", ref)


FAULTY_RUN = """
import resource, signal, sys
from pathlib import Path
import torchcls.training.build as build
from torchcls.cli import main

mode, at, run_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])

def fault(step):
    if step != at:
        return
    if mode == "readonly":  # the run dir and everything in it
        for p in (run_dir, *run_dir.rglob("*")):
            p.chmod(p.stat().st_mode & ~0o222)
    else:  # "quota": no file may grow past the size of the weights (+4 KiB) any more: EFBIG, as a quota would
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = (run_dir / "checkpoints" / "last.safetensors").stat().st_size + 4096
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

real = build.build
def build_with_fault(*a, **k):
    t = real(*a, **k)
    t.callbacks.append(fault)
    return t
build.build = build_with_fault
sys.exit(main(sys.argv[4:]))
"""


def _without_permission_override() -> None:
    """In the child, before exec: root loses the capabilities that let it write where permissions say no
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER), so a read-only run dir stops it as it stops a user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: the exec'd process cannot hold it
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("mode, unwritten, why", [
    ("readonly", "metrics.jsonl", r"Permission denied \[EACCES\]"),  # the next write: step 3's log record
    ("quota", "checkpoints/last.state.safetensors", r"File too large \[EFBIG\]"),  # step 4: its weights fit, its state not
])
def test_a_run_dir_that_stops_taking_writes_names_the_file_and_keeps_the_checkpoint(
        reference, tmp_path: Path, mode: str, unwritten: str, why: str) -> None:
    """Used to end in a raw PermissionError / RuntimeError traceback."""
    data, ref, _ = reference
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY_RUN)
    run = tmp_path / "runs" / "faulty"
    cmd = [sys.executable, str(script), mode, "2", str(run), "train", "--data", str(data), "--out-dir",
           str(tmp_path / "runs"), "--name", "faulty", *ARGS]
    drop = _without_permission_override if os.geteuid() == 0 and mode == "readonly" else None
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300, preexec_fn=drop)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert re.search(rf"could not write {re.escape(str(run / unwritten))}: {why}\. The last checkpoint "
                     rf"\({re.escape(str(run / 'checkpoints'))}, step 2\) is intact", out), out[-3000:]
    for p in (run, *run.rglob("*")):
        p.chmod(p.stat().st_mode | 0o200)
    assert not list(run.rglob("*.tmp"))  # the cut-short write left nothing behind
    cfg = _config(data, tmp_path / "runs", "faulty")
    cfg.run.resume = True
    _train(cfg)  # from step 2: the run ends as if nothing had happened
    assert _records(run) == _records(ref) and _same_weights(run, ref)


def test_a_report_that_cannot_be_written_names_it(reference, tmp_path: Path) -> None:
    """The last write of a run (report.html, here a directory in its way: EISDIR) fails like the others."""
    data, _, per_epoch = reference
    run = tmp_path / "blocked"

    def block(step):
        if step == 2 * per_epoch:
            (run / "report.html").mkdir()

    with pytest.raises(UserError, match=rf"could not write {run / 'report.html'}: Is a directory \[EISDIR\]\. "
                                        rf"The last checkpoint \({run / 'checkpoints'}, step {2 * per_epoch}\) is "
                                        "intact"):
        _train(_config(data, tmp_path, "blocked"), [block])

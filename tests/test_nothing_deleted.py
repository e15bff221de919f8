"""Nothing is deleted on a file's word (issue 30, finding 5): a run dir is removed only by the process that
created it, while its name still leads to that very directory; an elastic restart moves aside at most,
and only on proof kept in torchrun's agent store, never on the `.created-by.json` a dir holds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import tiny_config
from torchcls.errors import UserError
from torchcls.made_dirs import identity, make_dir, make_dirs, move_aside, remove_made
from torchcls.training import distributed
from torchcls.training.rundir import CREATED_BY, RunDir, job_id

SRC = Path(__file__).resolve().parents[1] / "src"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _victim(root: Path, job: str) -> Path:
    """runs/victim as in the issue: a user's notes and a hand-written marker naming the job."""
    victim = root / "victim"
    victim.mkdir(parents=True)
    (victim / "notes.txt").write_text("mine")
    (victim / CREATED_BY).write_text(json.dumps({"job": job}))
    return victim


def _fail_before_first_step(monkeypatch) -> None:
    from torchcls.training import build as build_module

    def fail(*a, **k):
        raise UserError("injected failure before the first step")

    monkeypatch.setattr(build_module, "build", fail)


# -- one process --------------------------------------------------------------------------------------
def test_a_failed_start_removes_the_dir_this_process_created(tmp_path, shapes_dir, monkeypatch) -> None:
    from torchcls.training import train

    _fail_before_first_step(monkeypatch)
    cfg = tiny_config(shapes_dir, tmp_path / "runs", "fresh")
    with pytest.raises(UserError, match="injected"):
        train(cfg)
    assert not (tmp_path / "runs" / "fresh").exists()  # the same command can simply be run again
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == []


def test_a_failed_start_in_a_dir_that_existed_moves_it_aside(tmp_path, shapes_dir, monkeypatch, capsys) -> None:
    """An empty dir the user made is used, but it is not this process's: after a failed start it is
    renamed aside (the same command can run again), not removed."""
    from torchcls.training import train

    _fail_before_first_step(monkeypatch)
    (tmp_path / "runs" / "empty").mkdir(parents=True)
    with pytest.raises(UserError, match="injected"):
        train(tiny_config(shapes_dir, tmp_path / "runs", "empty"))
    aside = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("empty.failed-start-")]
    assert len(aside) == 1 and (aside[0] / CREATED_BY).is_file()
    assert not (tmp_path / "runs" / "empty").exists()
    assert "moved aside" in capsys.readouterr().out


def test_a_forged_marker_never_gets_a_dir_removed(tmp_path, shapes_dir, monkeypatch) -> None:
    """A dir whose hand-written marker names this very process's job: the start refuses it, and even a
    RunDir pointed at it by hand does not remove it on a failed start."""
    from torchcls.training import train

    _fail_before_first_step(monkeypatch)
    victim = _victim(tmp_path / "runs", job_id())
    before = _files(victim)
    with pytest.raises(UserError, match="already exists"):
        train(tiny_config(shapes_dir, tmp_path / "runs", "victim"))
    assert _files(victim) == before
    assert RunDir(victim).discard_failed_start() is False
    assert (victim / "notes.txt").exists() or any((tmp_path / "runs").glob("victim.failed-start-*/notes.txt"))


def test_a_created_dir_replaced_before_the_cleanup_is_not_removed(tmp_path, shapes_dir) -> None:
    cfg = tiny_config(shapes_dir, tmp_path / "runs", "swap")
    run = RunDir.prepare(cfg)
    assert run.made is not None and run.made.still_here()
    run.path.rename(tmp_path / "runs" / "moved")
    run.path.mkdir()
    (run.path / "notes.txt").write_text("someone else's")
    assert run.discard_failed_start() is False
    assert (run.path / "notes.txt").read_text() == "someone else's" and (tmp_path / "runs" / "moved").is_dir()
    # A symlink put at the name is never followed
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    made = make_dir(tmp_path / "mine")
    os.rmdir(made.path)
    os.symlink(target, made.path)
    assert remove_made(made) is False and (target / "keep").exists()


def test_made_dirs_helpers(tmp_path) -> None:
    top = make_dirs(tmp_path / "a" / "b" / "c")
    assert top is not None and top.path == tmp_path / "a" and (tmp_path / "a" / "b" / "c").is_dir()
    assert make_dirs(tmp_path / "a" / "b") is None  # existed: nothing of it is ours
    (tmp_path / "a" / "b" / "c" / "f").write_text("x")
    assert remove_made(top) and not (tmp_path / "a").exists()
    with pytest.raises(FileExistsError):
        make_dir(tmp_path)
    d = tmp_path / "d"
    d.mkdir()
    aside = move_aside(d, "previous")
    assert aside.parent == tmp_path and aside.name.startswith("d.previous-") and not d.exists()


# -- the elastic restart's decision, in this process ------------------------------------------------
def test_a_restart_without_proof_leaves_a_dir_its_marker_claims(tmp_path) -> None:
    """Finding 5's decision: the marker names the job, no checkpoint, no record in the agent's store (none
    at all with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or one of another dir): refused, nothing changed."""
    victim = _victim(tmp_path, "myjob")
    before = _files(victim)
    store = dist.HashStore()
    for s in (None, store):
        decision = distributed._restart_decision(victim, "myjob", s)
        assert "holds no checkpoint" in decision and "left as it is" in decision, decision
        assert _files(victim) == before
    # a record for the dir that was at this name before (a copy with the marker put in its place)
    store.set(distributed._made_key(victim), "1:2")
    assert "left as it is" in distributed._restart_decision(victim, "myjob", store)
    assert _files(victim) == before


def test_a_restart_moves_aside_the_dir_its_first_start_made(tmp_path) -> None:
    """With the store's record of this very dir, an earlier start of this job made it: moved aside (every
    file kept), and the restart starts again."""
    run = _victim(tmp_path, "myjob")
    store = dist.HashStore()
    store.set(distributed._made_key(run), identity(run))
    assert distributed._restart_decision(run, "myjob", store) == "start"
    aside = list(tmp_path.glob("victim.failed-start-*"))
    assert not run.exists() and len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "mine"


def test_a_marker_that_is_a_fifo_names_no_job(tmp_path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    os.mkfifo(run / CREATED_BY)
    assert distributed._restart_decision(run, "myjob", None) == "start"  # not ours: the start refuses it


# -- real torchrun ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "myjob", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "torchcls", "train", *args]
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               TMPDIR=str(tmp_path / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), **env)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("shared_store", [False, True], ids=["own-store", "agent-store"])
def test_finding5_an_elastic_restart_leaves_a_dir_it_did_not_create(tmp_path, shared_store) -> None:
    """The issue's command: the first start refuses runs/victim; its restart matched the hand-written
    marker, found no checkpoint and removed the tree. Now both starts refuse and the dir is untouched."""
    victim = _victim(tmp_path / "runs", "myjob")
    before = _files(victim)
    env = {} if shared_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = _torchrun(tmp_path, ["--data", "mnist-5k", "--epochs", "2", "--workers", "0", "--parallel", "ddp",
                                "--name", "victim"], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "run dir runs/victim already exists" in out  # the first start
    if shared_store:  # the job is "myjob/<token drawn by its first start>": the marker does not even match
        assert "runs/victim was not created by this torchrun job" in out, out[-4000:]
    else:  # the marker matches: it proves nothing, so the restart refuses too
        assert "holds no checkpoint" in out and "left as it is" in out, out[-4000:]
    assert _files(victim) == before and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["victim"]


@pytest.mark.slow
def test_an_elastic_restart_after_a_start_that_saved_nothing_moves_its_dir_aside(tmp_path, shapes_dir) -> None:
    """Rank 1 dies at step 1, before any checkpoint: the restart finds the dir its first start made (as the
    agent's store recorded it), moves it aside and trains from the start."""
    args = ["--data", str(shapes_dir), "--model", "smallnet", "--img-size", "32", "--batch-size", "8",
            "--epochs", "1", "--workers", "0", "--no-progress", "--precision", "fp32", "--parallel", "ddp",
            "--dist-timeout", "120", "--name", "again"]
    proc = _torchrun(tmp_path, args, {"TORCHCLS_FAULT_STEP": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "TORCHCLS_FAULT_STEP=1: rank 1 kills itself" in out and "moved aside to again.failed-start-" in out
    aside = list((tmp_path / "runs").glob("again.failed-start-*"))
    assert len(aside) == 1 and (aside[0] / CREATED_BY).is_file()
    assert (tmp_path / "runs" / "again" / "checkpoints" / "last.safetensors").is_file()


# -- other removals of a path named by input ---------------------------------------------------------------
def test_the_demo_moves_an_existing_dir_aside_and_the_gallery_removes_only_its_thumbnails(tmp_path) -> None:
    from torchcls.demo import _start_fresh
    from torchcls.evaluation.worst_errors import _remove_thumbnails

    mine = tmp_path / "Documents"  # `torchcls demo --out-dir ~ --name Documents` used to delete it
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    _start_fresh(mine)
    assert not mine.exists() and [p.name for p in tmp_path.glob("Documents.previous-*/thesis.tex")]
    folder = tmp_path / "misclassified"
    folder.mkdir()
    for name in ("00.png", "15.png", "notes.txt", "16.png"):
        (folder / name).write_text("x")
    (folder / "01.png").mkdir()
    _remove_thumbnails(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["01.png", "16.png", "notes.txt"]

"""Restarts after a crash: the window between the two renames of a sharded (DCP) commit, the
generation of the rendezvous store every start of a torchrun job gets, and ranks racing to
write the same manifest."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import make_image_folder, tiny_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_env(monkeypatch, restart: int) -> None:
    """What torchrun sets for a world of one: the real process group (gloo) in this process."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port()), "TORCHELASTIC_RUN_ID": "job-1",
                 "TORCHELASTIC_RESTART_COUNT": str(restart)}.items():
        monkeypatch.setenv(k, v)


def _resumed_at(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["kind"] == "resume"]


def test_a_crash_between_the_two_renames_of_a_dcp_commit_resumes_the_newer_step(
        tmp_path: Path, shapes_dir: Path, monkeypatch) -> None:
    from torchcls.checkpoint import dcp
    from torchcls.checkpoint.checkpointer import Checkpointer
    from torchcls.training import train

    def run(epochs: int, resume: bool, restart: int = 0):
        _torchrun_env(monkeypatch, restart)
        cfg = tiny_config(shapes_dir, tmp_path, "window", epochs=epochs)
        cfg.parallel.parallel, cfg.parallel.dist_timeout, cfg.run.resume = "ddp", 60, resume
        cfg.governance.lineage = False
        return train(cfg)

    ckpt = tmp_path / "window" / "checkpoints"
    last, tmp, old = ckpt / "last.dcp", ckpt / ".last.dcp.tmp", ckpt / ".last.dcp.old"
    run(1, False)
    first = dcp.saved_step(last)
    shutil.copytree(last, tmp_path / "first.dcp")
    run(2, True)
    second = dcp.saved_step(last)
    assert first < second
    # The state a crash between the commit's two renames leaves: last.dcp already moved to .old, the
    # finished write (meta.json inside) not yet renamed. The restart used to find no checkpoint and
    # delete the whole run dir (this job created it), checkpoints and all.
    last.rename(tmp)
    shutil.copytree(tmp_path / "first.dcp", old)
    assert not Checkpointer(ckpt).has_state()
    run(3, False, restart=1)
    assert _resumed_at(tmp_path / "window")[-1] == second  # the newer checkpoint, not the older one
    assert dcp.saved_step(last) > second and not tmp.exists() and not old.exists()

    # Nothing newer than .old (no finished .tmp): .old is put back, and nothing is deleted.
    shutil.rmtree(last)
    shutil.copytree(tmp_path / "first.dcp", old)
    (tmp / "partial").mkdir(parents=True)  # a write a crash cut short (no .metadata, no meta.json)
    assert "restored" in Checkpointer(ckpt).recover()
    assert dcp.saved_step(last) == first and (tmp / "partial").is_dir()


def test_every_rank_of_a_start_gets_the_same_fresh_generation(tmp_path: Path) -> None:
    """A counter of ranks started numbered the attempts: a rank that died before adding itself put
    every later attempt's ranks into different key spaces (each waiting for peers that never came)."""
    from torchcls.training.distributed import _generation_store

    world = 3
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def start(ranks: list[int], timeout: float = 20.0) -> dict[int, str]:
        prefixes: dict[int, str] = {}
        attempt = f"attempt-{id(prefixes)}"

        def rank_main(rank: int) -> None:
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
            try:
                _, store = _generation_store(client, rank, world, timeout)
                store.set(f"seen/{rank}", attempt)  # lands under the generation's prefix
                prefixes[rank] = _prefix_of(client, rank, attempt)
            except (RuntimeError, TimeoutError) as e:
                prefixes[rank] = f"failed: {type(e).__name__}"

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return prefixes

    first = start([0, 1, 2])
    assert len(set(first.values())) == 1 and not first[0].startswith("failed")
    # Attempt 2: rank 2 dies before it reaches the store; rank 0 gives up waiting for it.
    second = start([0, 1], timeout=1.0)
    assert second[0] == "failed: TimeoutError"
    # Attempt 3: every rank agrees on one generation, and it is not the first attempt's.
    third = start([2, 1, 0])
    assert len(set(third.values())) == 1 and not third[0].startswith("failed")
    assert third[0] != first[0]


def _prefix_of(client: dist.TCPStore, rank: int, attempt: str) -> str:
    """The generation whose key space holds this rank's 'seen' key of this attempt."""
    generation = 1
    while True:
        key = f"torchcls/generation_{generation}/seen/{rank}"
        if client.check([key]) and client.get(key).decode() == attempt:
            break
        generation += 1
        assert generation < 100
    return f"generation_{generation}"


def test_ranks_storing_the_same_manifest_at_once_never_collide(tmp_path: Path) -> None:
    """Each writer has its own temporary file: one fixed temporary name made concurrent writers
    rename each other's file away (FileNotFoundError) or publish a half-written one."""
    from torchcls.governance.manifest import build_manifest, load_manifest
    from torchcls.governance.store import store_built

    manifests = [build_manifest(str(make_image_folder(tmp_path / f"d{i}", per_class=2, size=8))) for i in range(2)]
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for _ in range(20):
                store_built(manifests[i % 2], tmp_path / "store")
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    stored = sorted((tmp_path / "store").glob("*.json"))
    assert len(stored) == 2 and all(load_manifest(p) for p in stored)
    assert not list((tmp_path / "store").rglob("*.tmp"))


if __name__ == "__main__":
    pytest.main([__file__])


def test_plateau_patience_carries_over_a_dcp_resume(tmp_path: Path, shapes_dir: Path, monkeypatch) -> None:
    """A DCP checkpoint keeps the plateau schedule's counters: its patience used to start again at
    every resume under torchrun, so a run resumed often enough never reduced its rate."""
    from torchcls.training import train

    def run(name: str, epochs: int, resume: bool, sched: str = "plateau") -> Path:
        _torchrun_env(monkeypatch, 0)
        cfg = tiny_config(shapes_dir, tmp_path, name, epochs=epochs)
        cfg.parallel.parallel, cfg.parallel.dist_timeout, cfg.run.resume = "ddp", 60, resume
        cfg.governance.lineage, cfg.train.log_every = False, 1
        # A rate too small to lower the validation loss (it drifts with the BatchNorm statistics):
        # after patience (2) + 1 epochs without a new best, the rate drops to a tenth.
        cfg.optim.sched, cfg.optim.lr, cfg.optim.warmup_epochs = sched, 1e-6, 0.0
        return train(cfg).run_dir

    def lrs(run_dir: Path) -> dict[int, float]:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["epoch"]: r["lr"] for r in records if r["kind"] == "step"}

    whole = lrs(run("whole", 6, False))
    run("split", 2, False)
    split = lrs(run("split", 6, True))
    assert whole[1] == pytest.approx(1e-6, rel=1e-6) and whole[6] == pytest.approx(1e-7, rel=1e-6)  # reduced
    assert split == pytest.approx(whole, rel=1e-6)  # at the same epoch after the resume
    # A checkpoint without the counters (another --sched, or written before they were saved) resumes
    # into a plateau schedule whose patience starts at the resume.
    run("switched", 1, False, sched="cosine")
    assert set(lrs(run("switched", 3, True))) == {1, 2, 3}


def test_a_job_without_an_identity_of_its_own_never_takes_a_run_dir_on_restart(tmp_path: Path, monkeypatch) -> None:
    """Several nodes, no --rdzv-id and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: every job's run id is "none" and
    no token tells them apart, so a restart took the run dir another such job created (resumed and overwrote
    it, or removed it when it held no checkpoint yet). Now such a job marks its dirs as its start's alone and
    a restart refuses, naming --rdzv-id and --resume, and changes nothing."""
    from torchcls.config import Config
    from torchcls.training import distributed
    from torchcls.training.rundir import CREATED_BY

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    jobs = []
    for _ in range(2):  # two jobs started alike: what each records as its job in the run dirs it creates
        s, cfg = distributed.Session(), Config()
        cfg.run.name = "r"
        distributed._agree_on_start(s, cfg, distributed._job_token(None))
        jobs.append(s.job)
    assert jobs[0] != jobs[1] and "none" not in jobs

    for checkpointed, marker in ((True, jobs[0]), (False, jobs[0]), (True, "none")):  # "none": an older torchcls's
        other = tmp_path / f"other-{checkpointed}-{marker[:4]}"  # made by an earlier job started the same way
        (other / "checkpoints").mkdir(parents=True)
        if checkpointed:
            (other / "checkpoints" / "last.state").write_bytes(b"state")
        (other / CREATED_BY).write_text(json.dumps({"job": marker}))
        before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
        decision = distributed._restart_decision(other, jobs[1])
        assert "cannot tell whether it created it" in decision and "--rdzv-id" in decision and "--resume" in decision
        assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
    assert distributed._restart_decision(tmp_path / "new", jobs[1]) == "start"
    assert distributed.job_of("none", "abc", "n") == "none/abc" and distributed.job_of("job-7", None, "n") == "job-7"

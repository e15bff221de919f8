"""Distributed training with REAL torchrun processes on CPU/gloo: DDP and FSDP2 against one
process, DCP resharding 2 → 1 and 1 → 2, per-rank memory, an elastic restart after a rank is
killed, and the bad-input paths. One tiny transformer (timm test_vit, 300k parameters, no
BatchNorm, so 2 ranks compute exactly what 1 process computes) on 32 real 32-px images.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_image_folder, tiny_config
from torchcls.checkpoint.files import LAST_STATE
from torchcls.errors import UserError

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[1] / "src"
COMMON = ["--model", "test_vit", "--img-size", "32", "--batch-size", "8", "--workers", "0", "--val-fraction",
          "0.25", "--augment", "none", "--no-progress", "--dist-timeout", "120",
          "--precision", "fp32"]  # compared with one process to 1e-4 (auto may pick bf16); fp8 jobs override it


EMA = ("--ema", "0.5", "--accum-steps", "2")
FP8_FSDP2 = ("--parallel", "fsdp2", "--epochs", "2", "--precision", "fp8", "--fp8-emulate", "--fp8-min-dim", "16")


class Runs:
    """Launches each torchrun job once per module, on first use."""

    def __init__(self, base: Path):
        self.base, self.data, self.out = base, make_image_folder(base / "shapes"), base / "runs"
        self.env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                        TMPDIR=str(base / "tmp"), OMP_NUM_THREADS="1",
                        TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"))
        (base / "tmp").mkdir()
        self.done: dict[str, subprocess.CompletedProcess] = {}

    def torchrun(self, name: str, nproc: int, *args: str, env: dict | None = None, restarts: int = 0,
                 ok: bool = True):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={restarts}", "-m", "torchcls", "train", "--data", str(self.data),
               "--out-dir", str(self.out), "--name", name, *COMMON, *args]
        proc = subprocess.run(cmd, env=dict(self.env, **(env or {})), capture_output=True, text=True, timeout=600)
        assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc

    def two_nodes(self, name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        """The job on two torchrun agents ("nodes", one process each) meeting at a c10d rendezvous on
        127.0.0.1, as on two machines; each may restart its workers once."""
        port, logs = _free_port(), [self.base / f"{name}.node{n}.log" for n in (0, 1)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=1", "-m", "torchcls",
               "train", "--data", str(self.data), "--out-dir", str(self.out), "--name", name, *COMMON, *args]
        procs = []
        for log in logs:
            with log.open("w") as f:  # a file each: two pipes read one after the other could fill and block
                procs.append(subprocess.Popen(cmd, env=dict(self.env, **(env or {})), stdout=f,
                                              stderr=subprocess.STDOUT, text=True))
        codes = [p.wait(timeout=600) for p in procs]
        out = "".join(log.read_text() for log in logs)
        assert codes == [0, 0], out[-6000:]
        return subprocess.CompletedProcess(cmd, 0, out, out)

    def get(self, key: str) -> Path:
        if key not in self.done:
            self.done[key] = getattr(self, f"_{key}")()
        return self.out / key.split("_")[0]

    def _single(self):  # the reference: one process, --parallel none, in this process
        from torchcls.training import train

        cfg = tiny_config(self.data, self.out, "single", epochs=2)
        cfg.model.name, cfg.data.val_fraction, cfg.data.augment = "test_vit", 0.25, "none"
        return train(cfg)

    def _emasingle(self):  # the reference for --ema with --accum-steps: one process
        from torchcls.training import train

        cfg = tiny_config(self.data, self.out, "emasingle", epochs=2)
        cfg.model.name, cfg.data.val_fraction, cfg.data.augment = "test_vit", 0.25, "none"
        cfg.optim.ema, cfg.optim.accum_steps = 0.5, 2
        return train(cfg)

    def _emaddp(self):
        return self.torchrun("emaddp", 2, "--parallel", "ddp", "--epochs", "2", *EMA)

    def _emafsdp(self):  # a rank fails at step 3; the restart resumes the step-2 DCP checkpoint (weights, optimizer, EMA)
        return self.torchrun("emafsdp", 2, "--parallel", "fsdp2", "--epochs", "2", "--save-every", "2", *EMA,
                             env={"TORCHCLS_FAULT_STEP": "3"}, restarts=1)

    def _fsdp2(self):  # the NaN/Inf check deferred to the device, as on CUDA: the fused step reads a flag
        return self.torchrun("fsdp2", 2, "--parallel", "fsdp2", "--epochs", "2", "--save-every", "2",
                             "--nonfinite-check", "deferred")

    def _fullinit(self):  # the same run, with every rank building the whole model before sharding
        return self.torchrun("fullinit", 2, "--parallel", "fsdp2", "--epochs", "2", "--save-every", "2",
                             "--no-fsdp-init-from-rank0")

    def _ddp(self):
        return self.torchrun("ddp", 2, "--parallel", "ddp", "--epochs", "2", "--async-checkpoint")

    def _w1(self):  # world size 1 for one epoch; a copy is kept before the 1 → 2 resume continues it
        proc = self.torchrun("w1", 1, "--parallel", "fsdp2", "--epochs", "1")
        shutil.copytree(self.out / "w1", self.base / "w1-copy" / "w1")
        return proc

    def _w1_to2(self):
        self.get("w1")
        return self.torchrun("w1", 2, "--parallel", "fsdp2", "--epochs", "2", "--resume")

    def _fp8ag(self):  # FP8 weights all-gathered by FSDP2 (torchao's emulation: the numerics, on CPU)
        return self.torchrun("fp8ag", 2, *FP8_FSDP2, "--fp8-fsdp-all-gather")

    def _fp8(self):  # the same FP8 FSDP2 run, all-gathering fp32 weights
        return self.torchrun("fp8", 2, *FP8_FSDP2)

    def _elastic(self):
        return self.torchrun("elastic", 2, "--parallel", "fsdp2", "--epochs", "2", "--save-every", "2",
                             env={"TORCHCLS_FAULT_STEP": "5"}, restarts=1)

    def _twonode(self):  # the same job and fault on two nodes; a short timeout, so that a hang fails soon
        return self.two_nodes("twonode", "--parallel", "fsdp2", "--epochs", "2", "--save-every", "2",
                              "--dist-timeout", "60", env={"TORCHCLS_FAULT_STEP": "5"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    base = tmp_path_factory.mktemp("dist")
    yield Runs(base)
    shutil.rmtree(base, ignore_errors=True)  # torchrun's torchelastic_* folders live in base/tmp


def _epochs(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x
            and json.loads(x)["kind"] == "epoch"]


def _figures(run: Path) -> list[dict]:
    """metrics.jsonl's records without their timings (the figures a restarted run shares)."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("img_per_s", "epoch_s")} for r in records]


def _weights(run: Path, name: str = "last.safetensors") -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / name)


def _assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_two_ranks_follow_the_one_process_trajectory(runs, mode):
    single, dist_run = runs.get("single"), runs.get(mode)
    ref, got = _epochs(single), _epochs(dist_run)
    assert [e["step"] for e in got] == [e["step"] for e in ref] == [3, 6]
    for r, g in zip(ref, got):
        assert g["world_size"] == 2
        for key in ("train_loss", "val_loss", "train_top1", "val_top1"):
            assert g[key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), key
    steps = lambda run: [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
                         if '"kind": "step"' in x]
    assert steps(dist_run) == pytest.approx(steps(single), rel=1e-4)
    _assert_close(_weights(single), _weights(dist_run), atol=2e-4)
    assert "run dir:" in runs.done[mode].stdout and runs.done[mode].stdout.count("run dir:") == 1  # rank 0 only


@pytest.mark.parametrize("mode", ["emaddp", "emafsdp"])
def test_ema_and_accumulation_under_torchrun_follow_one_process(runs, mode):
    """DDP (no_sync on the inner micro-batch) and FSDP2 (no reduce-scatter on it; EMA shards in the DCP
    checkpoint, resumed) give the one-process run's losses, EMA validation and weights."""
    single, dist_run = runs.get("emasingle"), runs.get(mode)
    if mode == "emafsdp":
        assert "resuming" in runs.done[mode].stdout + runs.done[mode].stderr  # the restart did resume
    ref, got = _epochs(single), _epochs(dist_run)
    assert [e["step"] for e in got] == [e["step"] for e in ref] == [2, 4]  # 3 micro-batches -> 2 steps an epoch
    for r, g in zip(ref, got):
        for key in ("train_loss", "val_loss", "ema_val_loss", "ema_val_top1"):
            assert g[key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), key
        assert g.get("best") == r.get("best")
    _assert_close(_weights(single), _weights(dist_run), atol=2e-4)
    _assert_close(_weights(single, "best.safetensors"), _weights(dist_run, "best.safetensors"), atol=2e-4)


def test_dcp_from_two_ranks_loads_into_one_process(runs, tmp_path):
    from torchcls.checkpoint.consolidate import consolidate
    from torchcls.evaluation import evaluate
    from torchcls.training import train

    run = runs.get("fsdp2")
    shards = sorted(p.name for p in (run / "checkpoints" / "last.dcp").iterdir())
    assert shards == ["meta.json", "shard-00001-model-00001-of-00001.safetensors",  # one shard file per rank,
                      "shard-00002-model-00001-of-00001.safetensors", "state.json"]  # no pickle (.metadata)
    for ckpt in (run, runs.get("ddp")):  # not a file of either run starts as a pickle does (PROTO 2-5)
        assert not [p for p in ckpt.rglob("*") if p.is_file() and p.read_bytes()[:2] in {b"\x80\x02", b"\x80\x03",
                                                                                        b"\x80\x04", b"\x80\x05"}]
    merged = load_file(consolidate(run, tmp_path / "merged.safetensors"))
    last = _weights(run)
    assert merged.keys() == last.keys() and all(torch.equal(merged[k], last[k]) for k in last)
    assert evaluate(run, workers=0)["n"] == 8  # the consolidated checkpoint serves evaluate as usual
    # DDP with the async writer: its DCP checkpoint holds the same weights as its consolidated file
    ddp = runs.get("ddp")
    merged = load_file(consolidate(ddp, tmp_path / "ddp.safetensors"))
    assert all(torch.equal(merged[k], v) for k, v in _weights(ddp).items())
    # resume the 2-rank run in one plain process (--parallel none) for a third epoch
    copy = tmp_path / "runs" / "fsdp2"
    shutil.copytree(run, copy)
    cfg = tiny_config(runs.data, tmp_path / "runs", "fsdp2", epochs=3)
    cfg.model.name, cfg.data.val_fraction, cfg.data.augment, cfg.run.resume = "test_vit", 0.25, "none", True
    result = train(cfg)
    assert result.steps == 9 and [e["epoch"] for e in _epochs(copy)] == [1, 2, 3]
    assert (copy / "checkpoints" / LAST_STATE).is_file()


def test_dcp_from_one_rank_resumes_on_two(runs):
    from torchcls.training import train

    runs.get("w1_to2")
    resumed = runs.out / "w1"
    assert [e.get("world_size") for e in _epochs(resumed)] == [1, 2]
    assert "resuming" in runs.done["w1_to2"].stdout
    # the same world-1 checkpoint continued by one plain process: same second epoch
    cfg = tiny_config(runs.data, runs.base / "w1-copy", "w1", epochs=2)
    cfg.model.name, cfg.data.val_fraction, cfg.data.augment, cfg.run.resume = "test_vit", 0.25, "none", True
    reference = train(cfg).run_dir
    assert _epochs(resumed)[1]["train_loss"] == pytest.approx(_epochs(reference)[1]["train_loss"], rel=1e-4)
    _assert_close(_weights(reference), _weights(resumed), atol=2e-4)


def test_per_rank_memory_halves_under_fsdp2_and_not_under_ddp(runs):
    runs.get("w1")
    one = json.loads((runs.base / "w1-copy" / "w1" / "memory.json").read_text())
    fsdp2 = json.loads((runs.get("fsdp2") / "memory.json").read_text())
    ddp = json.loads((runs.get("ddp") / "memory.json").read_text())
    (w1,) = one["ranks"]
    assert one["world_size"] == 1 and w1["total_bytes"] == one["full_total_bytes"] > 4_000_000
    for kind in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert w1[kind] > 0
        for r in fsdp2["ranks"]:
            assert r[kind] == pytest.approx(w1[kind] / 2, rel=0.01), kind
        assert sum(r[kind] for r in fsdp2["ranks"]) == pytest.approx(w1[kind], rel=1e-3)
        for r in ddp["ranks"]:
            assert r[kind] == w1[kind]
    for r in fsdp2["ranks"]:
        assert r["expected_total_bytes"] == pytest.approx(fsdp2["full_total_bytes"] / 2, rel=1e-3)
        assert r["peak_rss_bytes"] > 50 * 2**20
    assert [r["rank"] for r in ddp["ranks"]] == [0, 1]
    assert all(r["expected_total_bytes"] == ddp["full_total_bytes"] for r in ddp["ranks"])
    assert "Per-rank memory (fsdp2, world size 2)" in (runs.get("fsdp2") / "report.html").read_text()


def test_killed_rank_restarts_and_matches_an_uninterrupted_run(runs):
    run = runs.get("elastic")
    log = runs.done["elastic"]
    assert "TORCHCLS_FAULT_STEP=5: rank 1 kills itself" in log.stderr
    assert re.search(r"elastic restart 1: resuming", log.stdout)
    assert [e["epoch"] for e in _epochs(run)] == [1, 2]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 6
    # restart resumed from the step-4 checkpoint; exact resume => the uninterrupted run's weights, and
    # its metrics: epoch 2's figures cover the steps before the checkpoint too
    _assert_close(_weights(runs.get("fsdp2")), _weights(run), atol=0)
    assert _figures(run) == _figures(runs.get("fsdp2"))


def test_a_node_killed_on_two_nodes_restarts_the_job_and_matches_an_uninterrupted_run(runs):
    """Each node's torchrun agent counts only its own workers' failures: the ranks of the node whose worker
    died used to wait in the restart's barrier, the other node's to refuse the run dir in a broadcast, until
    the gloo timeout ended the job. torchrun sets OMP_NUM_THREADS=1 only for several processes per node:
    runs.env sets it for every job, so one process per node computes exactly what two on one node do."""
    run, log = runs.get("twonode"), runs.done["twonode"]
    assert "TORCHCLS_FAULT_STEP=5: rank 1 kills itself" in log.stdout
    assert "resuming" in log.stdout and "at epoch 2, step 4 (world size 2)" in log.stdout
    _assert_close(_weights(runs.get("fsdp2")), _weights(run), atol=0)  # max |dweight| = 0
    assert _figures(run) == _figures(runs.get("fsdp2"))


def test_a_restart_never_resumes_a_run_its_job_did_not_create(runs):
    """`cp -a runs/fsdp2 runs/keep2`, then a job on it without --resume: its first start is refused ("already
    exists"), and its restart used to resume runs/keep2 and overwrite its checkpoints, config and metrics."""
    keep = runs.out / "keep2"
    shutil.copytree(runs.get("fsdp2"), keep)
    before = {p: p.read_bytes() for p in keep.rglob("*") if p.is_file()}
    proc = runs.torchrun("keep2", 2, "--parallel", "fsdp2", "--epochs", "3", restarts=1, ok=False)
    out = proc.stdout + proc.stderr
    assert out.count(f"run dir {keep} already exists") >= 2  # both starts refused it
    assert f"{keep} was not created by this torchrun job" in out
    assert {p: p.read_bytes() for p in keep.rglob("*") if p.is_file()} == before


def test_fsdp2_weights_from_rank0_equal_every_rank_building_the_model(runs):
    run, full = runs.get("fsdp2"), runs.get("fullinit")
    assert "fsdp2: rank 0 built the model; 2 rank(s) hold only their shards" in runs.done["fsdp2"].stdout
    assert "rank 0 built the model" not in runs.done["fullinit"].stdout
    assert [e["train_loss"] for e in _epochs(run)] == [e["train_loss"] for e in _epochs(full)]
    _assert_close(_weights(full), _weights(run), atol=0)


def test_fsdp2_all_gathers_fp8_weights_and_tracks_fp32(runs):
    run, log = runs.get("fp8ag"), runs.done["fp8ag"]
    # test_vit: 6 blocks × (qkv, proj, fc1, fc2) Linear layers; the head (2 outputs) is not divisible by 16
    assert "fsdp2: 24 weight(s) all-gathered in FP8" in log.stdout
    assert json.loads((run / "precision.json").read_text())["fp8"]["fsdp_float8_all_gather"] is True
    ref, got = _epochs(runs.get("fsdp2")), _epochs(run)
    assert [e["step"] for e in got] == [3, 6]
    for r, g in zip(ref, got):  # FP8 (emulated) training follows the fp32 trajectory closely
        assert abs(r["train_loss"] - g["train_loss"]) < 0.1, (r["train_loss"], g["train_loss"])
    # Casting to FP8 before the all-gather instead of after it changes the traffic, not the numerics
    plain = runs.get("fp8")
    assert [e["train_loss"] for e in _epochs(plain)] == [e["train_loss"] for e in got]
    _assert_close(_weights(plain), _weights(run), atol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_distributed_input(runs, tmp_path, monkeypatch):
    from torchcls.checkpoint.checkpointer import Checkpointer
    from torchcls.training import train
    from torchcls.training.distributed import Session

    cfg = tiny_config(runs.data, tmp_path, "bad")
    cfg.parallel.parallel = "fsdp2"
    with pytest.raises(UserError, match="needs processes started by torchrun"):
        train(cfg)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match="missing rendezvous endpoint: MASTER_ADDR and MASTER_PORT"):
        train(cfg)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(UserError, match="--batch-size 8 is the global batch and must be divisible by the world "
                                        "size 3"):
        train(cfg)
    cfg.parallel.parallel = "none"
    with pytest.raises(UserError, match="started with 3 processes .* but --parallel none"):
        train(cfg)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k)
    # a single-process run's unsharded state cannot be resumed by ranks
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    torch.save({"step": 1}, legacy / "checkpoints" / "last.state.pt")
    with pytest.raises(UserError, match="written by a single process"):
        Checkpointer(legacy / "checkpoints", Session(active=True, world=2)).resume(None, None, None, None)
    # a sharded checkpoint from another model
    shutil.copytree(runs.get("fsdp2"), tmp_path / "runs" / "other")
    cfg = tiny_config(runs.data, tmp_path / "runs", "other", epochs=3)
    cfg.data.val_fraction, cfg.run.resume = 0.25, True  # smallnet instead of test_vit
    with pytest.raises(UserError, match="is from another model \\(test_vit.*than this run \\(smallnet"):
        train(cfg)


def test_unreachable_rendezvous_endpoint_fails_fast(runs):
    env = dict(runs.env, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, "-m", "torchcls", "train", "--data", str(runs.data), "--out-dir",
                           str(runs.out), "--name", "nowhere", "--parallel", "ddp", "--dist-timeout", "5",
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rank 1 could not join the process group at 127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr


class _WithScratchBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        # not in the state dict, so set_model_state_dict cannot carry it: rank0_init broadcasts it
        self.register_buffer("scale", torch.rand(4), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale


def test_rank0_init_gives_a_seeded_builds_weights_buffers_and_rng(tmp_path):
    import torch.distributed as dist

    from torchcls.config import ParallelConfig
    from torchcls.training import rank0_init
    from torchcls.training.parallel import parallelize

    torch.manual_seed(3)
    ref = _WithScratchBuffer()
    rng_after_build = torch.get_rng_state()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = ParallelConfig(parallel="fsdp2")
        torch.manual_seed(3)
        model, weights = rank0_init.build_on_meta(_WithScratchBuffer, rank=0)
        assert model.fc.weight.is_meta and weights.buffers.keys() == {"scale"}
        assert torch.equal(torch.get_rng_state(), rng_after_build)
        model = parallelize(model, cfg, torch.device("cpu"))
        rank0_init.materialize(model, weights, torch.device("cpu"), cfg)
        assert weights.state is None and weights.buffers is None  # rank 0 lets go of the whole model
        assert torch.equal(model.scale, ref.scale)
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), ref.get_parameter(name)), name
        x = torch.randn(2, 8)
        assert torch.equal(model(x), ref(x))
    finally:
        dist.destroy_process_group()

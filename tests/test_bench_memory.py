"""`torchcls bench memory`: real torchrun jobs (gloo) at world sizes 1 and 2, the analytic model,
and the fit advice for a heterogeneous cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchcls.suite import memory_fit as mf

SRC = Path(__file__).resolve().parents[1] / "src"
GiB = 2**30


def _torchcls(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", TMPDIR=str(cwd))
    return subprocess.run([sys.executable, "-m", "torchcls", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_fsdp2_halves_the_state_at_two_ranks_and_the_small_device_limits_the_batch(tmp_path):
    out = tmp_path / "bench"
    proc = _torchcls("bench", "memory", "--model", "test_vit", "--img-size", "32", "--world-sizes", "1,2",
                     "--device-memory", "3GiB,1200MiB,3GiB,1200MiB", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "bench_memory.json").read_text())
    runs = {(r["parallel"], r["world"]): r for r in data["results"]}
    assert set(runs) == {("ddp", 1), ("fsdp2", 1), ("ddp", 2), ("fsdp2", 2)}
    assert all(r["status"] == "ok" for r in runs.values()), {k: r.get("error") for k, r in runs.items()}
    full = runs["fsdp2", 1]["ranks"][0]["total_bytes"]
    assert full == runs["fsdp2", 1]["ranks"][0]["full_state_bytes"] > 1_000_000  # test_vit: ~1.4 MB of fp32 params
    for rank in runs["fsdp2", 2]["ranks"]:  # sharded: half of world 1, as the analytic model says
        assert rank["total_bytes"] == pytest.approx(full / 2, rel=0.01)
        assert rank["state_vs_world1"] == pytest.approx(0.5, abs=0.01)
        assert rank["expected_state_bytes"] == pytest.approx(rank["total_bytes"], rel=0.01)
    for rank in runs["ddp", 2]["ranks"]:  # replicated: every rank holds it all
        assert rank["total_bytes"] == full and rank["state_vs_world1"] == 1.0
    r0 = runs["fsdp2", 2]["ranks"][0]
    assert r0["activation_bytes_per_sample"] > 0 and r0["measured_peak_bytes"] > r0["expected_peak_bytes"]
    assert r0["measured_peak_bytes"] >= 0.99 * r0["memory_before_steps_bytes"] > 0
    assert 0 < r0["largest_unit_bytes"] < full / 4  # one transformer block, not the whole model

    fits = {(f["parallel"], f["world"]): f for f in data["fit"]["configs"]}
    assert fits["fsdp2", 2]["limiting_ranks"] == [1] and fits["fsdp2", 4]["projected"]
    assert fits["ddp", 4]["limiting_ranks"] == [1, 3]
    big, small = fits["ddp", 2]["ranks"]  # 3 GiB, 1.2 GiB
    assert fits["ddp", 2]["max_batch_per_rank"] == small["max_batch"] < big["max_batch"]
    assert "rank 1 (1.2 GiB) limits the batch" in fits["fsdp2", 2]["verdict"]
    assert data["fit"]["recommendation"].startswith("on 4 rank(s):")
    md = (out / "bench_memory.md").read_text()
    assert "| fsdp2 | 2 | 1 |" in md and "(projected)" in md
    assert (out / "bench_memory.png").stat().st_size > 1000
    assert "rank 1 (1.2 GiB)" in proc.stdout

    from torchcls.report import write_report

    html = write_report(out).read_text()
    assert "data-section='bench_memory'" not in html and 'alt="bench_memory"' in html


def test_unknown_model_and_bad_sizes_are_clear_errors(tmp_path):
    proc = _torchcls("bench", "memory", "--model", "vit_bse_patch16_224", "--out", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "unknown model 'vit_bse_patch16_224'" in proc.stderr
    assert "vit_base_patch16_224" in proc.stderr and "Traceback" not in proc.stderr
    proc = _torchcls("bench", "memory", "--model", "smallnet", "--device-memory", "80 gigs", cwd=tmp_path)
    assert proc.returncode == 2 and "--device-memory '80 gigs': cannot read it as a size" in proc.stderr
    assert mf.parse_size("80GiB", "x") == 80 * GiB and mf.parse_size("1.5 GB", "x") == 1_500_000_000


def test_a_configuration_that_cannot_start_is_skipped_with_the_reason():
    from torchcls.suite.memory_scaling import BenchMemoryConfig, cannot_start, full_state_bytes

    cfg = BenchMemoryConfig("vit_giant_patch14_224", ["ddp"], [8])
    state = full_state_bytes(cfg)  # built on the meta device: nothing allocated
    assert state > 16 * 1e9 * 0.95  # ~1B parameters × (param + grad + 2 AdamW moments) × 4 bytes
    assert "of host RAM" in cannot_start(cfg, "ddp", 8, state)


def test_fit_names_the_limiting_ranks_and_what_does_not_fit():
    m = mf.RankModel(state_bytes=10 * GiB, transient_bytes=1 * GiB, activation_bytes_per_sample=0.1 * GiB)
    caps = mf.capacities([80 * GiB, 40 * GiB], 4)
    assert caps == [80 * GiB, 40 * GiB, 80 * GiB, 40 * GiB]
    f = mf.fit("fsdp2", 4, [m] * 4, caps, overhead=GiB, projected=False)
    # 40 GiB × 0.9 = 36 GiB; minus 12 GiB fixed = 24 GiB / 0.1 GiB per sample = 240 (float rounding: 239-240)
    assert f["limiting_ranks"] == [1, 3] and f["max_batch_per_rank"] in (239, 240)
    assert f["max_global_batch"] == 4 * f["max_batch_per_rank"]
    assert "ranks 1, 3 (40.0 GiB) limit the batch" in f["verdict"]
    huge = mf.RankModel(state_bytes=50 * GiB, transient_bytes=0, activation_bytes_per_sample=GiB)
    g = mf.fit("ddp", 2, [huge] * 2, [80 * GiB, 40 * GiB], overhead=GiB, projected=True)
    assert g["max_batch_per_rank"] == 0 and "does not fit: rank 1 (40.0 GiB) lacks 15.0 GiB" in g["verdict"]
    assert "shard with fsdp2" in g["verdict"] and "(projected)" in g["verdict"]
    assert mf.recommend([f, g]) == f"on 4 rank(s): fsdp2 up to {f['max_batch_per_rank']} images per rank"


def test_a_job_that_fails_is_started_once_more_and_both_errors_are_kept(tmp_path):
    from torchcls.suite.memory_scaling import BenchMemoryConfig, launch

    # launch is called directly, past the checks: 3 px is no multiple of test_vit's 16 px patches, and
    # each rank's forward raises (an exception, not the worker's own refusal): started twice.
    r = launch(BenchMemoryConfig("test_vit", ["ddp"], [1], img_size=3), "ddp", 1, tmp_path)
    assert r["status"] == "failed" and r["error"].startswith("torchrun exited 1: AssertionError: Input height (3)")
    assert r["first_attempt_error"] == r["error"]
    # The worker's own refusal (an unknown model) would only repeat: started once.
    r = launch(BenchMemoryConfig("no_such_model", ["ddp"], [1], img_size=32), "ddp", 1, tmp_path)
    assert r["error"].startswith("torchrun exited 1: error: unknown model 'no_such_model'")
    assert "first_attempt_error" not in r


def test_the_failing_rank_s_exception_is_reported_not_torchrun_s_summary():
    from torchcls.suite.memory_scaling import worker_error

    # As torchrun prints a rank's failure: its traceback lines prefixed with [rank0]:, then the summary.
    stderr = ("W1204 14:00:59 torch/distributed/run.py:803] Setting OMP_NUM_THREADS\n"
              "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in <module>\n"
              "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
              "E1204 14:00:59 api.py:1002] failed (exitcode: 1) local_rank: 0\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert worker_error(stderr).startswith("RuntimeError: [../third_party/gloo")
    assert worker_error("error: unknown model 'x'\n" + stderr) == "error: unknown model 'x'"
    assert worker_error("") == "no output"

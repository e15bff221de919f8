"""The device check without a device: its plan (parts that fit one call, part 1 first things first, a CPU
stand-in for every part-1 step), every command line it would run, the runner (timeouts, killed process
groups, a crash named by its signal, a diagnosis step that runs only after a failure, what --collect
brings back), the per-GEMM FP8 script's dry run, and the AOTInductor loader called once."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu/check.py")
    check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = check  # dataclasses resolve the module by name
    spec.loader.exec_module(check)
    return check


def test_dry_run_plan_fits_each_part_in_one_call_and_part_one_comes_first():
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu/check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)  # exactly one JSON object on stdout
    steps = {s["name"]: s for s in plan["steps"]}
    assert len(steps) == len(plan["steps"]) >= 20
    assert plan["part_budget_s"]["1"] == 480 and all(plan["parts"][p] <= plan["part_budget_s"][p] for p in plan["parts"])
    for part, budget in plan["parts"].items():
        assert budget == sum(s["budget_s"] for s in plan["steps"] if int(part) in s["parts"] and not s["only_if_failed"])
    part1 = [s["name"] for s in plan["steps"] if 1 in s["parts"]]
    assert part1.index("fp8_gemm") < part1.index("fp8") < part1.index("aoti_compile") < part1.index("data_feed")
    assert {"preflight", "aoti_smoke", "aoti_load", "aoti_parity", "jpeg_data", "data_feed"} <= set(part1)
    # every part-1 step can be rehearsed on a CPU, except the diagnosis that needs cuda-gdb after a failure
    assert [n for n in part1 if not steps[n]["rehearsal"]] == ["aoti_backtrace"]
    assert steps["aoti_backtrace"]["only_if_failed"] == "aoti_load" and plan["conditional_s"] == {"aoti_backtrace": 45}
    assert steps["fp8_fsdp_all_gather"]["rehearsal"] and steps["decode_train"]["rehearsal"]


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU report")
def test_check_refuses_without_gpu_and_records_skips(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu/check.sh"), "--out", str(tmp_path), "--part", "1"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr
    result = json.loads((tmp_path / "check.json").read_text())
    assert result["steps"][0]["status"] == "fail"
    assert all(s["status"] == "skipped" for s in result["steps"][1:])
    assert "| step |" in (tmp_path / "check.md").read_text()


def test_every_command_line_parses_and_every_script_exists(tmp_path):
    """The GPU commands and the CPU stand-ins alike: a flag renamed elsewhere would otherwise surface only on
    a GPU machine (or in the rehearsal)."""
    from torchcls.cli import build_parser

    check = load_check()
    ctx, parser, parsed = check.Ctx(tmp_path, sys.executable), build_parser(), 0
    (tmp_path / "fp8_gemm.json").write_text(json.dumps({"gpu": "NVIDIA H200", "rows": []}))
    for step in check.STEPS:
        for commands in (step.commands, step.rehearsal):
            for cmd in commands(ctx) if commands else []:
                if "torchcls" in cmd and cmd[1] == "-m":
                    parser.parse_args(cmd[cmd.index("torchcls") + 1:])
                    parsed += 1
                elif "cuda-gdb" not in cmd[0]:
                    assert Path(cmd[1]).is_file(), cmd
    assert parsed >= 14
    fp8 = next(s for s in check.STEPS if s.name == "fp8").commands(ctx)[0]
    assert fp8[fp8.index("--fp8-table") + 1] == str(tmp_path / "fp8_gemm.json")  # part 1's table feeds the rule
    assert check.with_needs({"inference_bench"}) == {"inference_bench", "export_aoti_cuda", "memory_report"}
    assert check.with_needs({"aoti_parity"}) == {"aoti_parity", "aoti_load", "aoti_compile", "memory_report"}


def test_parts_cover_every_step_and_share_only_what_they_need():
    check = load_check()
    parts = [check.selected(p, None) for p in ("1", "2", "3")]
    assert set().union(*parts) == {s.name for s in check.STEPS} == check.selected("all", None)
    assert parts[0] & parts[1] == {"env", "memory_report", "jpeg_data"} and parts[0] & parts[2] == {"env"}
    assert check.selected("2", "serve_throughput") == {"env", "serve_throughput", "export_aoti_cuda", "memory_report"}


def test_runner_kills_overruns_names_signals_runs_diagnosis_after_failure_and_collects(tmp_path, monkeypatch):
    check = load_check()
    marker = tmp_path / "orphan"
    segv = "import ctypes, time; time.sleep(4); ctypes.string_at(0)"  # a real SIGSEGV, 4 s in
    monkeypatch.setattr(check, "STEPS", [
        check.Step("env", 5, "stand-in", lambda c: [["true"]]),
        check.Step("slow", 2, "overruns", lambda c: [["bash", "-c", f"(sleep 4; touch {marker}) & sleep 30"]]),
        check.Step("after_slow", 5, "needs slow", lambda c: [["true"]], needs=("slow",)),
        check.Step("why_slow", 5, "diagnosis", lambda c: [["true"]], only_if_failed="slow"),
        check.Step("why_env", 5, "not needed", lambda c: [["true"]], only_if_failed="env"),
        check.Step("crash", 20, "dies", lambda c: [[sys.executable, "-c", segv]]),
        check.Step("late", 5, "no time left", lambda c: [["true"]]),
    ])
    monkeypatch.setattr(check, "MIN_STEP_S", 10)
    monkeypatch.setattr(sys, "argv", ["check.py", "--out", str(tmp_path / "out"), "--budget", "16",
                                      "--collect", str(tmp_path / "back")])
    assert check.main() == 1
    steps = {s["name"]: s for s in json.loads((tmp_path / "out" / "check.json").read_text())["steps"]}
    assert steps["env"]["status"] == "pass"
    assert steps["slow"]["status"] == "fail" and "timed out" in steps["slow"]["reason"] and steps["slow"]["seconds"] < 10
    assert steps["after_slow"]["status"] == "skipped" and "needs slow" in steps["after_slow"]["reason"]
    assert steps["why_slow"]["status"] == "pass"
    assert steps["why_env"]["status"] == "skipped" and "only when env failed" in steps["why_env"]["reason"]
    assert steps["crash"]["status"] == "fail" and "killed by SIGSEGV" in steps["crash"]["reason"]
    assert steps["late"]["status"] == "skipped" and "total budget spent" in steps["late"]["reason"]
    log = (tmp_path / "out" / "logs" / "crash.log").read_text()
    assert "Fatal Python error: Segmentation fault" in log  # PYTHONFAULTHANDLER is set for every step
    back = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert back == ["check.json", "check.md", "results.tar.gz"] and len(back) <= 8
    with tarfile.open(tmp_path / "back" / "results.tar.gz") as tar:
        assert "logs/crash.log" in tar.getnames() and "check.json" in tar.getnames()
    time.sleep(3)
    assert not marker.exists()  # the background child of the killed step died with it


def test_fp8_gemm_dry_run_writes_the_table_the_layer_rule_reads(tmp_path):
    from torchcls.precision.fp8_rule import MeasuredTable

    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu/fp8_gemm.py"), "--json", str(out), "--dry-run",
                           "--device", "cpu", "--reps", "2", "--no-compile"], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {(r["layer"], r["recipe"]): r for r in data["rows"]}
    assert set(rows) == {(layer, recipe) for layer in ("fc1", "fc2", "square") for recipe in ("tensorwise", "rowwise")}
    fc1 = rows[("fc1", "tensorwise")]
    assert set(fc1["bf16_gemm_ms"]) == {"forward", "grad_input", "grad_weight", "total"} and fc1["roofline_ceiling"] > 0
    if fc1["errors"] is None:  # this CPU ran _scaled_mm: torchao's Float8Linear ran as well (eager here)
        assert fc1["linear_speedup"] > 0 and fc1["fp8_linear_ms"] > 0
    else:  # oneDNN has no FP8 matmul for this CPU (seen held to AVX2): said per GEMM and per layer, not fatal
        assert "matmul" in fc1["errors"]["tensorwise/forward"] and "matmul" in fc1["linear_error"], fc1
        assert fc1["linear_speedup"] is None
    assert "| backbone | layer |" in proc.stdout
    table = MeasuredTable.load(out)
    measured = table.lookup(32, 64, 128, "tensorwise")  # None where the layer did not run: the rule falls back
    assert table.gpu == "cpu" and (measured and measured["linear_speedup"]) == fc1["linear_speedup"]


def test_aoti_package_is_loaded_once_and_its_own_error_reported(aoti_export, monkeypatch):
    """torch's aoti_load_package retries a failed load through its legacy loader (a second load of the same
    package in the process); torchcls calls AOTInductor's loader once and reports that attempt's error."""
    from torchcls.artifacts.targets.aoti import AOTIArtifact
    from torchcls.errors import UserError

    real = torch._C._aoti.AOTIModelPackageLoader
    attempts = []

    class Failing:
        load_metadata_from_package = staticmethod(real.load_metadata_from_package)

        def __init__(self, *args):
            attempts.append(args)
            raise RuntimeError("CUDA driver error: stand-in for a load that fails")

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Failing)
    with pytest.raises(UserError, match="not a loadable AOTInductor package .*stand-in for a load that fails"):
        AOTIArtifact(aoti_export.path, device="cpu")
    assert len(attempts) == 1
    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", real)
    assert AOTIArtifact(aoti_export.path, device="cpu")(torch.zeros(2, 3, 32, 32)).shape[0] == 2

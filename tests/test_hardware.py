"""Defaults chosen from the hardware: --precision auto (bf16 only where the CPU or GPU computes it natively),
the warning for an explicit bf16 that the CPU emulates, the intra-op thread count from affinity and the
cgroup quota, and the machine record of a run. The detection functions are fed the flags, the cgroup folder
and the environment, so the native and the emulated case both run on any machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from torchcls.config import PrecisionConfig
from torchcls.errors import UserError
from torchcls.machine import (
    CpuActivity,
    CpuBudget,
    cgroup_cpu_limit,
    choose_threads,
    cpu_budget,
    cpu_flags,
    describe_machine,
    machine_line,
    other_work,
    simd_level,
)
from torchcls.precision import hardware
from torchcls.precision.hardware import choose_precision, cpu_bf16_native, require_fp16
from torchcls.toml_compat import tomllib

CPU = torch.device("cpu")
SRC = Path(__file__).resolve().parents[1] / "src"
EPYC_AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # the AMD EPYC where bf16 ran ~12x slower than fp32
ZEN4 = EPYC_AVX2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}
SKYLAKE_X = EPYC_AVX2 | {"avx512f", "avx512bw"}
NATIVE = (True, "fake CPU with avx512_bf16")
EMULATED = (False, "fake AVX2 CPU")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(hardware, "_warned", set())


@pytest.mark.parametrize("flags, level, native", [
    (EPYC_AVX2, "AVX2", False), (SKYLAKE_X, "AVX-512", False), (ZEN4, "AVX-512-bf16", True),
    (SAPPHIRE_RAPIDS, "AMX", True),
    ({"avx2", "avx512_f", "avx512_bf16"}, "AVX-512-bf16", True),  # torch's capability names
])
def test_auto_picks_bf16_only_where_the_cpu_computes_it(flags, level, native):
    assert simd_level(flags) == level
    ok, why = cpu_bf16_native(flags, "AVX512", {})
    assert ok is native
    choice = choose_precision("auto", CPU, cpu=(ok, why))
    assert (choice.requested, choice.precision, choice.reason) == ("auto", "bf16" if native else "fp32", why)
    if native:
        assert "native" in why and "avx512_bf16" in why
    else:
        assert f"({level})" in why and "emulated" in why


@pytest.mark.parametrize("capability, env, fragment", [
    ("AVX2", {"ATEN_CPU_CAPABILITY": "avx2"}, "ATEN_CPU_CAPABILITY=avx2"),
    ("DEFAULT", {}, "limited to DEFAULT"),
    ("AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "ONEDNN_MAX_CPU_ISA=AVX2"),
    ("AVX512", {"DNNL_MAX_CPU_ISA": "avx512_core"}, "DNNL_MAX_CPU_ISA=AVX512_CORE"),
])
def test_a_capability_forced_down_counts_as_emulated(capability, env, fragment):
    ok, why = cpu_bf16_native(SAPPHIRE_RAPIDS, capability, env)
    assert not ok and fragment in why and "emulated" in why
    assert cpu_bf16_native(SAPPHIRE_RAPIDS, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"})[0]


@pytest.mark.parametrize("asked", ["fp32", "bf16", "fp16", "fp8"])
def test_an_explicit_precision_runs_as_given(asked, fresh_warnings, capsys):
    choice = choose_precision(asked, CPU, cpu=NATIVE)
    assert (choice.requested, choice.precision, choice.warning) == (asked, asked, "")
    assert capsys.readouterr().out == ""


def test_explicit_bf16_without_native_bf16_runs_and_warns_once_with_the_cost(fresh_warnings, capsys):
    first = choose_precision("bf16", CPU, cpu=EMULATED)
    again = choose_precision("bf16", CPU, cpu=EMULATED)
    assert first.precision == again.precision == "bf16"  # it runs: the user asked for it
    out = capsys.readouterr().out
    assert out.count("warning: --precision bf16") == 1
    assert "fake AVX2 CPU" in out and "12x slower than fp32" in out and "picks fp32 here" in out
    assert "12x" in first.warning
    inference = choose_precision("bf16", CPU, kind="inference", cpu=EMULATED)
    assert "9-11x slower" in inference.warning


def test_fp16_refusal_recommends_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: EMULATED)
    with pytest.raises(UserError, match=r"use --precision fp32 or auto \(fake AVX2 CPU\)") as e:
        require_fp16(CPU)
    assert "bf16 (or auto)" not in str(e.value)
    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: NATIVE)
    with pytest.raises(UserError, match=r"use --precision bf16 \(or auto\) on this CPU"):
        require_fp16(CPU)


def test_auto_on_a_gpu_follows_its_bf16_hardware(monkeypatch):
    monkeypatch.setattr(hardware, "describe_device", lambda d: "a GPU")
    for supported, expected in ((True, "bf16"), (False, "fp32")):
        seen = {}

        def is_bf16_supported(including_emulation=True, supported=supported):
            seen["including_emulation"] = including_emulation
            return supported

        monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
        choice = choose_precision("auto", torch.device("cuda"))
        assert choice.precision == expected and seen == {"including_emulation": False}  # emulated bf16 is not bf16


def test_an_avx2_machine_emulated_in_a_subprocess(tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 make this machine choose as an AVX2-only one does."""
    code = ("import torch\n"
            "from torchcls.errors import UserError\n"
            "from torchcls.precision.hardware import choose_precision, require_fp16\n"
            "cpu = torch.device('cpu')\n"
            "print('AUTO', choose_precision('auto', cpu).precision, choose_precision('auto', cpu).reason)\n"
            "choose_precision('bf16', cpu)\n"
            "try:\n    require_fp16(cpu)\nexcept UserError as e:\n    print('FP16', e)\n"
            # oneDNN's int8 GEMM held to AVX2 (no VNNI) saturates: int8 inference is refused, not wrong
            "from torchcls.precision.hardware import cpu_int8_matmul_exact\n"
            "from torchcls.precision.inference import apply_inference_precision\n"
            "print('INT8 exact', cpu_int8_matmul_exact())\n"
            "try:\n    apply_inference_precision(torch.nn.Linear(64, 64), 'int8')\n"
            "except UserError as e:\n    print('INT8', e)\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    auto = next(line for line in out.stdout.splitlines() if line.startswith("AUTO"))
    assert auto.startswith("AUTO fp32 ") and "emulated" in auto
    assert out.stdout.count("warning: --precision bf16 on this CPU runs") == 1
    fp16 = next(line for line in out.stdout.splitlines() if line.startswith("FP16"))
    assert "use --precision fp32 or auto" in fp16
    # Held to AVX2, an AVX-512 Xeon's oneDNN int8 GEMM saturates; a real AVX2 CPU's (AMD Zen 3) was exact, and
    # there int8 is allowed. Either way the refusal follows the kernel check, never the flags alone.
    refused = "INT8 int8 inference: this CPU's int8 matrix multiply" in out.stdout
    assert ("INT8 exact False" in out.stdout and refused) or ("INT8 exact True" in out.stdout and not refused)


# ---------------------------------------------------------------- threads from affinity and quota

def test_cgroup_v2_quota_of_this_cgroup_and_its_ancestors(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/\n") is None
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/\n") == 2.0
    pod = tmp_path / "kubepods" / "pod1"
    pod.mkdir(parents=True)
    (pod / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/kubepods/pod1\n") == 1.5  # the tightest on the way up
    (tmp_path / "kubepods" / "cpu.max").write_text("50000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/kubepods/pod1\n") == 0.5
    assert cgroup_cpu_limit(tmp_path, "0::/elsewhere/on/the/host\n") == 2.0  # no cgroup namespace: the root


def test_cgroup_v1_cfs_quota(tmp_path):
    cpu = tmp_path / "cpu,cpuacct"
    cpu.mkdir()
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path, "4:cpu,cpuacct:/\n") is None
    (cpu / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_limit(tmp_path, "4:cpu,cpuacct:/\n") == 3.0


def test_threads_follow_the_quota_and_the_affinity_mask(tmp_path):
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    pod = cpu_budget(tmp_path, "0::/\n", affinity=set(range(64)))  # a 2-CPU pod on a 64-core node
    assert (pod.logical, pod.affinity, pod.quota, pod.usable) == (os.cpu_count(), 64, 2.0, 2)
    choice = choose_threads(0, 0, pod, env={})
    assert choice.threads == 2 and "cgroup quota 2 CPUs" in choice.reason
    assert choose_threads(0, 0, CpuBudget(64, 64, 1.5), env={}).threads == 1  # floor: 1.5 CPUs is one thread
    assert choose_threads(0, 0, CpuBudget(64, 3, None), env={}).threads == 3  # taskset -c 0-2
    assert choose_threads(0, 0, CpuBudget(8, 8, 0.2), env={}).threads == 1


def test_threads_leave_room_for_loader_workers_and_obey_what_is_asked():
    two, eight = CpuBudget(2, 2, None), CpuBudget(8, 8, None)
    assert choose_threads(0, 0, two, env={}).threads == 2  # in-memory feed: no worker processes
    shared = choose_threads(0, 2, two, env={})
    assert shared.threads == 1 and "1 left to 2 loader worker(s)" in shared.reason
    assert choose_threads(0, 2, eight, env={}).threads == 6
    assert choose_threads(0, 16, eight, env={}).threads == 4  # workers get at most half
    assert choose_threads(0, 0, eight, env={"LOCAL_WORLD_SIZE": "2"}).threads == 4  # torchrun's processes share
    assert choose_threads(0, 2, eight, env={"OMP_NUM_THREADS": "3"}) == \
        type(shared)(3, "OMP_NUM_THREADS=3")
    assert choose_threads(5, 2, two, env={"OMP_NUM_THREADS": "3"}) == type(shared)(5, "--threads 5")


def _times(seconds: dict[int, tuple[float, float]], guest: float = 0.0) -> list:
    """psutil.cpu_times(percpu=True) of a fake machine: CPU c spent `seconds[c] = (busy, idle)` in user and
    idle time, and `guest` seconds of its user time running a virtual machine (Linux counts it twice)."""
    kind = type(psutil.cpu_times())  # this platform's fields
    return [kind(**{f: {"user": b, "idle": i, "guest": guest}.get(f, 0.0) for f in kind._fields})
            for _, (b, i) in sorted(seconds.items())]


def test_other_work_is_what_keeps_cpus_busy_besides_this_process():
    before = _times({0: (0, 0), 1: (0, 0)})
    after = _times({0: (1.0, 0), 1: (0.5, 0.5)}, guest=0.25)  # 1.5 CPUs busy over one second
    assert other_work({0, 1}, before, after, own_cpu_s=1.5) == (0, "")  # all of it ours (the data loading)
    n, line = other_work({0, 1}, before, after, own_cpu_s=0.5)
    assert n == 1 and "other work kept 1.0 of 2 CPU(s) busy" in line
    assert other_work({0, 1}, before, _times({0: (1.0, 0), 1: (1.0, 0)}), own_cpu_s=0.0)[0] == 1  # one thread left
    assert other_work({0, 1, 7}, before, after, own_cpu_s=0.5)[0] == 1  # a CPU psutil does not list is left out
    assert other_work({0, 1}, before, before, own_cpu_s=0.0) == (0, "")  # no time passed
    two = CpuBudget(2, 2, None)
    busy = choose_threads(0, 0, two, env={}, busy=(1, line))
    assert busy.threads == 1 and line in busy.reason
    # ranks on one node (a launcher that sets LOCAL_WORLD_SIZE, not OMP_NUM_THREADS) see each other's loading
    assert choose_threads(0, 0, CpuBudget(4, 4, None), env={"LOCAL_WORLD_SIZE": "2"}, busy=(1, line)).threads == 2


def test_this_machine_is_read_through_torch_and_psutil():
    """The facts come from torch (flags, model, capability) and psutil (counts, affinity, CPU times); the line
    the benchmarks print keeps its shape."""
    caps = torch.cpu.get_capabilities()
    assert cpu_flags() == {k for k, v in caps.items() if v is True}
    m = describe_machine()
    assert m["cpu"] == (caps.get("cpu_name") or m["cpu"]) and m["torch_cpu_capability"] == \
        torch.backends.cpu.get_cpu_capability() and m["simd"] == simd_level(cpu_flags())
    affinity = len(psutil.Process().cpu_affinity()) if hasattr(psutil.Process, "cpu_affinity") else psutil.cpu_count()
    assert (m["cores"]["logical"], m["cores"]["affinity"]) == (psutil.cpu_count(), affinity)
    assert re.fullmatch(rf"{re.escape(m['cpu'])} \({re.escape(m['simd'])}; torch \w+\), \d+ usable of "
                        rf"{psutil.cpu_count()} CPUs \((no quota|quota [\d.]+)\), torch threads \d+(, .*)?", machine_line(m))
    n, line = CpuActivity().busy()
    assert 0 <= n < affinity and (line == "") == (n == 0)


@pytest.mark.slow
def test_a_busy_cpu_gets_no_thread_and_a_resume_keeps_the_count(tmp_path):
    from conftest import make_image_folder, tiny_config
    from torchcls.training import train

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    cfg = tiny_config(make_image_folder(tmp_path / "shapes", per_class=4), tmp_path / "runs", epochs=1)
    cfg.train.threads = 0  # the default rule, not tiny_config's fixed count
    spin = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{max(os.sched_getaffinity(0))}}})"
                             "\nwhile True: pass"])
    try:
        run = train(cfg).run_dir
    finally:
        spin.kill()
        spin.wait()
    machine = json.loads((run / "machine.json").read_text())
    # the spinning process's CPU is left out (on more CPUs, other busy ones may be too)
    threads = machine["torch_threads"]
    assert 1 <= threads <= len(os.sched_getaffinity(0)) - 1 and "other work kept" in machine["threads_reason"]
    cfg.train.epochs, cfg.run.resume = 2, True
    train(cfg)  # quiet now, but the run keeps the count it started with
    machine = json.loads((run / "machine.json").read_text())
    assert machine["torch_threads"] == threads and "(resume)" in machine["threads_reason"]


def test_demo_takes_threads():
    from torchcls.cli import build_parser
    from torchcls.demo import demo_config

    args = build_parser().parse_args(["demo", "--threads", "1"])
    assert args.threads == 1 and demo_config(threads=1).train.threads == 1 and demo_config().train.threads == 0


# ---------------------------------------------------------------- what a run records

@pytest.fixture(scope="module")
def auto_run(tmp_path_factory) -> Path:
    """A run with the defaults (--precision auto, layout and threads left to the machine), briefly trained."""
    from conftest import make_image_folder, tiny_config
    from torchcls.training import train

    base = tmp_path_factory.mktemp("auto")
    cfg = tiny_config(make_image_folder(base / "shapes", per_class=8), base / "runs", "auto", epochs=1)
    cfg.precision.precision, cfg.train.channels_last, cfg.train.threads = "auto", None, 0
    return train(cfg).run_dir


def test_a_run_records_what_was_asked_what_ran_and_why(auto_run):
    rule = choose_precision("auto", CPU)
    # What ran is the rule's precision, or fp32 where bf16 is native but the timed step chose fp32 (step_choice)
    step = json.loads((auto_run / "step_choice.json").read_text())["precision"]
    assert step["precision"] == rule.precision or (step["precision"] == "fp32" and step["reason"].startswith(
        f"{rule.reason}, but fp32 trains this model faster here"))
    recorded = json.loads((auto_run / "precision.json").read_text())
    assert (recorded["requested"], recorded["precision"], recorded["reason"]) == \
        ("auto", step["precision"], step["reason"])
    assert tomllib.loads((auto_run / "config.toml").read_text())["precision"]["precision"] == "auto"
    machine = json.loads((auto_run / "machine.json").read_text())
    assert machine["precision"] == step["precision"] and machine["simd"] and machine["cpu"]
    assert machine["cores"]["usable"] >= 1 and machine["torch_threads"] >= 1
    assert "usable CPU(s)" in machine["threads_reason"]  # the run sets no --threads
    from torchcls.report import write_report

    html = write_report(auto_run).read_text()
    assert f"precision {step['precision']} (auto: " in html and machine_line(machine) in html


def test_precision_json_says_why_auto_chose_fp32(tmp_path, monkeypatch, fresh_warnings):
    from torchcls.models import SmallNet
    from torchcls.precision.training import apply_precision
    from torchcls.training.rundir import RunDir

    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: EMULATED)
    plan = apply_precision(SmallNet(2, 1), PrecisionConfig(), CPU, RunDir(tmp_path))
    recorded = json.loads((tmp_path / "precision.json").read_text())
    assert plan.name == "fp32" and plan.autocast().__class__.__name__ == "nullcontext"
    assert (recorded["requested"], recorded["precision"], recorded["reason"]) == ("auto", "fp32", "fake AVX2 CPU")
    plan = apply_precision(SmallNet(2, 1), PrecisionConfig(precision="bf16"), CPU, RunDir(tmp_path))
    recorded = json.loads((tmp_path / "precision.json").read_text())
    assert plan.name == "bf16" and "12x slower" in recorded["warning"]


# ---------------------------------------------------------------- the same rule for inference

def test_export_auto_builds_fp32_where_the_target_cannot_build_bf16():
    from torchcls.artifacts.exporter import _check_request
    from torchcls.artifacts.targets import get_target
    from torchcls.artifacts.targets.base import ExportRequest

    bf16 = choose_precision("auto", CPU, cpu=NATIVE)
    req, choice = _check_request(get_target("aoti"), ExportRequest("bf16", 8), bf16)
    assert req.precision == choice.precision == "bf16"
    for target, early_exit in (("onnx", False), ("aoti", True)):
        req, choice = _check_request(get_target(target), ExportRequest("bf16", 8, early_exit=early_exit), bf16)
        assert req.precision == choice.precision == "fp32" and choice.requested == "auto"
        assert choice.reason.startswith("fake CPU with avx512_bf16, but this export builds fp32 only")
    with pytest.raises(UserError, match="fp32 only"):  # asked for explicitly: refused as before
        _check_request(get_target("onnx"), ExportRequest("bf16", 8), choose_precision("bf16", CPU, cpu=NATIVE))


def test_eager_inference_follows_the_rule(monkeypatch):
    from torchcls.artifacts.artifact import _as_exported
    from torchcls.models import SmallNet
    from torchcls.precision.inference import CastIO, eager_for_inference

    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: NATIVE)
    model, choice = eager_for_inference(SmallNet(2, 1), "auto", CPU)
    assert isinstance(model, CastIO) and choice.precision == "bf16"
    assert model(torch.randn(2, 1, 28, 28)).dtype == torch.float32
    model, choice = eager_for_inference(SmallNet(2, 1), "auto", CPU, fp32_only="it exits early")
    assert not isinstance(model, CastIO) and choice.reason.endswith("but it exits early")
    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: EMULATED)
    model, choice = eager_for_inference(SmallNet(2, 1), "auto", CPU)
    assert not isinstance(model, CastIO) and (choice.precision, choice.reason) == ("fp32", "fake AVX2 CPU")
    exported = SimpleNamespace(info=SimpleNamespace(precision="fp32", target="onnx"))
    assert _as_exported(exported, "auto") is exported and _as_exported(exported, "fp32") is exported
    with pytest.raises(UserError, match="exported in fp32, which it keeps"):
        _as_exported(exported, "bf16")


def test_bench_compile_says_when_bf16_is_emulated(monkeypatch):
    from torchcls.suite.compile_gains import BenchCompileConfig, emulated_bf16_note, to_markdown

    cfg = BenchCompileConfig(["smallnet"], [1], ["fp32", "bf16"], ["default"])
    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: EMULATED)
    note = emulated_bf16_note(cfg)
    assert note.startswith("bf16 is emulated on this machine (fake AVX2 CPU)")
    assert emulated_bf16_note(BenchCompileConfig(["smallnet"], [1], ["fp32"], ["default"])) == ""
    machine = {"cpu": "x", "simd": "AVX2", "torch_cpu_capability": "AVX2", "torch_threads": 2, "precision": "bf16",
               "cores": {"logical": 2, "affinity": 2, "quota": None, "usable": 2}, "bf16_note": note}
    assert note in to_markdown({"machine": machine, "results": [], "verdicts": {}})
    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: NATIVE)
    assert emulated_bf16_note(cfg) == ""

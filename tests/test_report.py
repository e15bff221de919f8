"""`torchcls report`: every section renders with its data, and says 'not run' without it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

SECTIONS = ("training", "evaluation", "exports", "compile", "memory", "audit", "config")
# Sections of features whose own tests render them with real runs (precision, distributed, bench memory,
# early-exit, governance tests); here they only have to say "not run" when their data is absent.
FEATURE_SECTIONS = ("samples", "precision", "early_exit", "rank_memory", "bench_memory", "governance")


def _not_run(html: str) -> set[str]:
    return set(re.findall(r"data-section='(\w+)'", html))


def test_empty_dir_says_not_run_everywhere(tmp_path):
    from torchcls.report import write_report

    html = write_report(tmp_path).read_text()
    assert _not_run(html) == set(SECTIONS) | set(FEATURE_SECTIONS)
    assert "torchcls bench compile" in html and "torchcls audit kernels" in html


def _results(run: Path) -> None:
    """Result files as the commands write them (memory from a real recorder, the rest in their formats)."""
    import torch

    from torchcls.memory.recorder import MemoryRecorder

    (run / "exports" / "aoti").mkdir(parents=True)
    (run / "exports" / "aoti" / "model.pt2").write_bytes(b"x")
    (run / "exports" / "aoti" / "parity.json").write_text(json.dumps(
        {"max_abs_diff": 4.8e-6, "top1_agreement": 1.0, "passed": True, "batch": {"min": 1, "max": 64}}))
    result = {"model": "smallnet", "batch": 16, "precision": "fp32", "mode": "default", "status": "ok",
              "eager_ms": {"median": 2.0, "min": 1.9, "max": 2.4}, "compiled_ms": {"median": 1.0, "min": 0.9, "max": 1.1},
              "speedup": 2.0, "compile_s": 12.5, "graphs": 1, "graph_breaks": 0, "recompiles": 1, "max_abs_diff": 1e-6}
    (run / "bench_compile.json").write_text(json.dumps({"machine": {"note": "test"}, "results": [result],
                                                        "verdicts": {"smallnet": "compile pays 2.00× at b16"}}))
    rec = MemoryRecorder(run, torch.device("cpu"))
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(1, 6):
        model(torch.randn(16, 64)).sum().backward()
        opt.step()
        rec(step)
    rec.finish()
    (run / "kernel_audit.json").write_text(json.dumps({
        "imports": ["kernels_example"], "device": {"capability": None}, "passed": False, "failures": ["x::y: opcheck"],
        "ops": [{"name": "x::y", "dispatch_keys": ["CPU"], "traceable": False, "status": "fail",
                 "checks": [{"name": "opcheck", "status": "fail", "detail": "test_faketensor failed", "fix": "fix fake"}]}],
        "binaries": [{"path": "/a/_C.so", "sm": ["sm_80"], "ptx": [], "check": {"status": "skip", "detail": "no GPU"}}],
        "triton_kernels": [], "model": {"target": "m", "exported": True, "custom_ops": {"x::y": 2}, "error": None}}))


def test_every_section_renders_with_data(trained_run, tmp_path, capsys):
    from torchcls.cli import main
    from torchcls.evaluation import evaluate

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    evaluate(run, workers=0)
    _results(run)
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    html = (run / "report.html").read_text()
    assert _not_run(html) <= set(FEATURE_SECTIONS)  # every evaluation-guide section has its data
    assert out.count("included") == len(SECTIONS) + len(FEATURE_SECTIONS) - len(_not_run(html))
    for text in ("top1_agreement", "model.pt2", "compile pays 2.00× at b16", "alt=\"bench_compile\"",
                 "need a CUDA device", "alt=\"memory\"", "fix fake", "sm_80", "x::y ×2", "alt=\"curves\""):
        assert text in html, text


def test_cuda_memory_section_renders(tmp_path):
    """The CUDA variant of allocator.json (as the recorder writes it on a GPU) renders its figures and advice."""
    from torchcls.memory.allocator import sample, summarize
    from torchcls.report import write_report

    samples = [sample({"allocated_bytes.all.current": 2**30, "reserved_bytes.all.current": 2**31,
                       "inactive_split_bytes.all.current": 2**30}, 1)]
    a = summarize({"allocated_bytes.all.peak": 2**30, "reserved_bytes.all.peak": 2**31, "num_alloc_retries": 0},
                  samples)
    (tmp_path / "allocator.json").write_text(json.dumps({"device": "cuda:0", "cuda": True, "samples": samples,
        "allocator": {"available": True} | a, "snapshot": {"file": "memory_snapshot.pickle"}}))
    html = write_report(tmp_path).read_text()
    assert "50.0%" in html and "expandable_segments:True" in html and "memory_snapshot.pickle" in html
    assert "memory" not in _not_run(html)

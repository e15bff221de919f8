"""`torchcls bench compile` on a tiny model with one known graph break (real subprocesses, real compile)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def test_bench_compile_counts_the_break_and_records_failures(tmp_path, monkeypatch):
    from torchcls.suite.compile_gains import BenchCompileConfig, bench_compile

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]))
    cfg = BenchCompileConfig(["bench_models:break_net", "bench_models:failing_net"], [2], ["fp32"], ["default"],
                             repeats=3)
    data = bench_compile(cfg, tmp_path)
    ok, failed = data["results"]
    assert ok["status"] == "ok" and ok["graphs"] == 2 and ok["graph_breaks"] == 1
    assert any("graph_break" in r for r in ok["break_reasons"])
    assert ok["eager_ms"]["n"] == ok["compiled_ms"]["n"] == 3 and ok["eager_ms"]["min"] <= ok["eager_ms"]["median"]
    assert ok["speedup"] > 0 and ok["compile_s"] > 0 and ok["recompiles"] >= 1
    assert ok["max_abs_diff"] < 1e-4 and ok["top1_agree"] == 1.0 and ok["peak_rss_bytes"] > 0
    assert failed["status"] == "failed" and "FailingNet always fails" in failed["error"]
    assert "breaks: 1 (" in data["verdicts"]["bench_models:break_net"]
    assert data["verdicts"]["bench_models:failing_net"].startswith("no result")
    saved = json.loads((tmp_path / "bench_compile.json").read_text())
    assert saved["results"][0]["graph_breaks"] == 1
    md = (tmp_path / "bench_compile.md").read_text()
    assert "| bench_models:break_net | 2 | fp32 | default |" in md and "failed: " in md
    assert (tmp_path / "bench_compile.png").stat().st_size > 1000


def test_bench_compile_rejects_unknown_model(tmp_path):
    from torchcls.errors import UserError
    from torchcls.suite.compile_gains import BenchCompileConfig, bench_compile

    with pytest.raises(UserError, match="resnet5O"):
        bench_compile(BenchCompileConfig(["resnet5O"], [1], ["fp32"], ["default"]), tmp_path)

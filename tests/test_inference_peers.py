"""benchmarks/inference_peers.py tells a real AVX2 CPU from the AVX2 stand-in (an AVX-512 CPU with torch and
oneDNN held to AVX2), since its tables say which one they measured. Fed the flags, capability and environment,
so every case runs on any machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torchcls.machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import inference_peers  # noqa: E402 (a benchmark script beside the package, not part of it)


@pytest.mark.parametrize("flags, capability, onednn_cap, stand_in", [
    ({"avx", "avx2"}, "AVX2", "", False),  # a real AVX2 CPU (e.g. AMD Zen 3): nothing is held back
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", "AVX2", True),  # the stand-in: AVX-512 held to AVX2
    ({"avx2", "avx512f"}, "AVX512", "AVX2", True),  # only oneDNN held: still a stand-in
    ({"avx2", "avx512f"}, "AVX512", "", False),  # the AVX-512 CPU as it is
])
def test_stand_in_is_an_avx512_cpu_held_below_it(monkeypatch, flags, capability, onednn_cap, stand_in):
    monkeypatch.setattr(torchcls.machine, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_cap)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert inference_peers.held_below_avx512() is stand_in
    note = inference_peers.isa_cap_note()
    assert (note is not None and note.startswith("AVX2 stand-in")) is stand_in


@pytest.mark.slow
def test_a_checkpoint_is_measured_on_its_own_size_and_held_out_images(trained_run, tmp_path):
    """`benchmarks/inference.py --checkpoint RUN`: the run's model at its input size (32 px here, not 224), every
    path's agreement with eager fp32 measured on its held-out images, the rows named after its model."""
    import json
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "inference.py"
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, str(script), "--checkpoint", str(trained_run), "--configs", "ort",
                           "--quick", "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out.with_suffix(".json")).read_text())
    assert result["size"] == 32 and result["checkpoint"] == str(trained_run)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "ort"}
    assert all(r["model"].startswith("smallnet (") for r in rows.values())
    # ONNX Runtime fp32 computes what eager does on the run's own images (a probe of random inputs would not
    # be the run's data); both paths were timed at batch 1 and 16
    assert rows["ort"]["top1_agreement"] == 1.0 and rows["ort"]["max_abs_diff"] < 1e-3
    held_out = json.loads((trained_run / "data_splits.json").read_text())["val"]["images"]
    assert rows["ort"]["probe_images"] == min(256, held_out)
    assert all(r["b1_ms"] > 0 and r["b16_ms"] > 0 for r in rows.values())
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(script), "--checkpoint", str(tmp_path / "none")], check=True,
                       capture_output=True, timeout=120)

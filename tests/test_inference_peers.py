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

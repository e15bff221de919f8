"""The allocator report: on this CPU machine, profiler memory events + RSS, and a clear 'needs CUDA'."""

from __future__ import annotations

import json

from conftest import make_image_folder, tiny_config


def test_cpu_memory_report_in_training(tmp_path):
    from torchcls.training import train

    cfg = tiny_config(make_image_folder(tmp_path / "shapes", per_class=12), tmp_path / "runs", "mem", epochs=1)
    cfg.data.batch_size, cfg.data.val_fraction = 4, 0.2  # 5 training steps: enough for the 3-step profile window
    cfg.train.memory_report, cfg.train.memory_snapshot = True, True
    run = train(cfg).run_dir
    m = json.loads((run / "allocator.json").read_text())
    assert m["device"] == "cpu" and m["cuda"] is False
    assert m["allocator"]["available"] is False and "need a CUDA device" in m["allocator"]["reason"]
    assert m["snapshot"]["file"] is None and "needs CUDA" in m["snapshot"]["reason"]
    p = m["profiler"]
    assert p["profiled_steps"] == 3 and p["allocated_bytes_total"] > 0
    assert p["top_ops"] and all(o["allocated_bytes"] > 0 and o["op"].startswith("aten::") for o in p["top_ops"])
    # the timeline peak holds at least the weights and activations of a training step
    assert p["timeline_peak_bytes"] > 0 and p["timeline_at_peak"]["parameter"] > 0
    assert p["timeline_at_peak"]["activation"] > 0 and (run / p["timeline_file"]).is_file()
    assert m["peak_rss_bytes"] > 50 * 2**20 and [s["step"] for s in m["samples"]] == [1, 2, 3, 4, 5]
    html = (run / "report.html").read_text()
    assert "need a CUDA device" in html and "At the timeline peak" in html and 'alt="memory"' in html


def test_allocator_summary_and_advice():
    """The CUDA arithmetic on the keys torch.cuda.memory_stats() returns (they are {} on this machine)."""
    from torchcls.memory import allocator

    samples = [allocator.sample({"allocated_bytes.all.current": 600, "reserved_bytes.all.current": 1000,
                                 "inactive_split_bytes.all.current": a}, step) for step, a in ((1, 100), (2, 300))]
    stats = {"allocated_bytes.all.peak": 800, "reserved_bytes.all.peak": 1000, "inactive_split_bytes.all.peak": 300,
             "num_alloc_retries": 2, "num_ooms": 0, "num_device_alloc": 8, "num_device_free": 0}
    s = allocator.summarize(stats, samples)
    assert s["fragmentation_pct_max"] == 30.0 and s["fragmentation_pct_last"] == 30.0
    assert abs(s["reserved_unused_pct_at_peak"] - 20.0) < 1e-9
    assert any("expandable_segments:True" in t for t in s["advice"]) and any("retries" in t for t in s["advice"])
    calm = allocator.summarize(stats | {"num_alloc_retries": 0}, samples[:1])
    assert calm["fragmentation_pct_max"] == 10.0 and calm["advice"] == []
    on = allocator.advice(s, "expandable_segments:True")
    assert not any("set PYTORCH_CUDA_ALLOC_CONF" in t for t in on)

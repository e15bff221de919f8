"""Early exits end to end: train ee/smallnet, evaluate with calibration and the report, explain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from conftest import make_image_folder, tiny_config


@pytest.fixture(scope="module")
def ee_run(tmp_path_factory) -> Path:
    from torchcls.training import train

    base = tmp_path_factory.mktemp("ee")
    cfg = tiny_config(make_image_folder(base / "shapes", per_class=24), base / "runs", "ee", epochs=3)
    cfg.model.name, cfg.data.val_fraction = "ee/smallnet", 0.25
    return train(cfg).run_dir


def test_evaluate_reports_exits_flops_latency_and_calibrates(ee_run):
    from torchcls.evaluation import evaluate

    r = evaluate(ee_run, workers=0, target_compute=0.9)
    ee = r["early_exit"]
    assert ee["exits"] == 3 and abs(sum(ee["exit_fractions"]) - 1) < 1e-6
    assert ee["relative_compute"] <= 0.9 and ee["calibration"]["chosen"]["relative_compute"] <= 0.9
    assert ee["exit_path_flops"][0] < ee["exit_path_flops"][1] < ee["exit_path_flops"][2]
    assert ee["mean_flops"] > 0 and ee["latency_ms_per_sample"] > 0 and ee["backbone_latency_ms_per_sample"] > 0
    assert abs(ee["accuracy"] - r["top1"]) < 1e-6  # the replayed rule = the real dynamic forward
    assert json.loads((ee_run / "eval.json").read_text())["early_exit"]["threshold"] == ee["threshold"]
    assert Image.open(ee_run / "exit_curve.png").size[0] > 100
    html = (ee_run / "report.html").read_text()
    assert "Early exit" in html and "data-section='early_exit'" not in html  # rendered, not 'not run'


def test_evaluate_rejects_bad_thresholds(ee_run, trained_run, capsys):
    from torchcls.cli import main

    assert main(["evaluate", str(ee_run), "--threshold", "1.5", "--workers", "0"]) == 2
    assert "--threshold = 1.5 is outside the allowed range [0, 1]" in capsys.readouterr().err
    assert main(["evaluate", str(trained_run), "--threshold", "0.5", "--workers", "0"]) == 2
    assert "apply to early-exit models" in capsys.readouterr().err


def test_explain_writes_overlays_for_plain_and_early_exit_models(ee_run, trained_run, tmp_path, capsys):
    from torchcls.cli import main

    shapes = make_image_folder(tmp_path / "imgs", per_class=1)
    images = [str(p) for p in sorted(shapes.rglob("*.png"))]
    assert main(["explain", str(ee_run), *images, "--steps", "8", "--out", str(tmp_path / "ee")]) == 0
    out = capsys.readouterr().out
    assert "(exit " in out and out.count("->") == 2
    assert main(["explain", str(trained_run), images[0], "--method", "saliency", "--out", str(tmp_path / "p")]) == 0
    for folder, n in (("ee", 2), ("p", 1)):
        pngs = sorted((tmp_path / folder).glob("*.png"))
        assert len(pngs) == n and all(Image.open(p).size[0] > 100 for p in pngs)
    assert main(["explain", str(trained_run), images[0], "--target", "triangle"]) == 2
    assert "not a class of this model" in capsys.readouterr().err

"""Multi-label classification end to end: a CSV `labels` column, BCE training, mAP/F1 validation and
per-label thresholds, evaluate, predict, export and serve (sigmoid probabilities, labels above threshold).

The data: 32x32 PNGs of noise where label `square` = a bright 10x10 square somewhere and label
`stripe` = a green horizontal stripe somewhere; an image has both, either or none.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import tiny_config
from torchcls.cli import main
from torchcls.errors import UserError

CLASSES = ["square", "stripe"]


def make_multilabel_csv(root: Path, n_train: int = 96, n_val: int = 48, size: int = 32, seed: int = 0,
                        column: str = "labels") -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    rows = [f"path,{column},split"]
    for i in range(n_train + n_val):
        square, stripe = i % 2 == 1, (i // 2) % 2 == 1
        img = rng.integers(0, 60, (size, size, 3)).astype(np.uint8)
        if square:
            y, x = rng.integers(0, size - 10, 2)
            img[y:y + 10, x:x + 10] = 255
        if stripe:
            r = int(rng.integers(0, size - 3))
            img[r:r + 3, :, 1] = 220
        Image.fromarray(img).save(root / f"img_{i:03d}.png")
        labels = ";".join(name for name, on in zip(CLASSES, (square, stripe)) if on)
        rows.append(f"img_{i:03d}.png,{labels},{'train' if i < n_train else 'val'}")
    (root / "data.csv").write_text("\n".join(rows) + "\n")
    return root / "data.csv"


def truth(i: int) -> set[str]:
    return {name for name, on in zip(CLASSES, (i % 2 == 1, (i // 2) % 2 == 1)) if on}


def ml_config(csv: Path, out: Path, name: str, epochs: int = 3, **data):
    # tiny_config's fixed choices (fp32, NCHW, 2 threads): the mAP bounds below must not move with the machine's load
    cfg = tiny_config(csv, out, name, epochs)
    cfg.data.task, cfg.data.batch_size = "multilabel", 16
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


@pytest.fixture(scope="module")
def ml_csv(tmp_path_factory) -> Path:
    return make_multilabel_csv(tmp_path_factory.mktemp("ml") / "data")


@pytest.fixture(scope="module")
def ml_run(ml_csv: Path) -> Path:
    from torchcls.training import train

    return train(ml_config(ml_csv, ml_csv.parent.parent / "runs", "ml")).run_dir


def val_images(csv: Path) -> list[tuple[Path, set[str]]]:
    return [(csv.parent / f"img_{i:03d}.png", truth(i)) for i in range(96, 144)]


# -- data --------------------------------------------------------------------------------------
def test_labels_column_gives_float_targets_on_both_loaders(ml_csv):
    from torchcls.config import DataConfig
    from torchcls.data import build_data, make_loader
    from torchcls.data.inmemory import bundle_loaders

    cfg = DataConfig(source=str(ml_csv), task="multilabel", img_size=32, workers=0, batch_size=8)
    bundle = build_data(cfg, seed=0)
    assert bundle.classes == CLASSES
    assert bundle.images.targets.dtype == torch.float32 and bundle.images.targets.shape == (96, 2)
    assert bundle.images.targets[:4].tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]  # '' / square / stripe / both
    _, y = next(iter(make_loader(bundle.train, 8, 0, shuffle=False)))
    assert y.shape == (8, 2) and y.dtype == torch.float32
    train, _, _ = bundle_loaders(bundle, cfg, seed=0)
    _, y = next(iter(train))
    assert y.shape == (8, 2) and y.dtype == torch.float32 and set(y.flatten().tolist()) <= {0.0, 1.0}


def test_held_out_split_is_stratified_by_label_set(ml_csv, tmp_path):
    from torchcls.data.loaders import stratified_split
    from torchcls.data.sources import open_source

    images = open_source(str(ml_csv), None, "train", None, "error")
    _, val = stratified_split(images.targets, 0.25, seed=0)
    combos = images.targets[val].tolist()
    assert len(val) == 24 and all(combos.count(c) == 6 for c in ([0, 0], [1, 0], [0, 1], [1, 1]))


# -- training, thresholds, evaluate ----------------------------------------------------------
def test_training_records_val_map_and_saves_thresholds(ml_run):
    from torchcls.checkpoint.files import read_meta

    epochs = [json.loads(line) for line in (ml_run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in epochs if r["kind"] == "epoch"]
    assert len(epochs) == 3 and all("val_top1" not in r for r in epochs)
    last = epochs[-1]
    assert last["val_map"] > 0.9  # chance is the positive rate, 0.5
    assert 0 <= last["val_f1"] <= 1 and 0 <= last["val_exact_match"] <= 1 and 0 <= last["train_top1"] <= 1
    meta = read_meta(ml_run / "checkpoints" / "best.safetensors")
    best = max(epochs, key=lambda r: r["val_map"])
    assert meta.task == "multilabel" and meta.thresholds == best["val_thresholds"] and len(meta.thresholds) == 2


def test_evaluate_writes_map_f1_per_label_and_thresholds(ml_run, capsys):
    from torchcls.checkpoint.files import read_meta

    assert main(["evaluate", str(ml_run), "--workers", "0"]) == 0
    assert "mAP" in capsys.readouterr().out
    result = json.loads((ml_run / "eval.json").read_text())
    assert result["task"] == "multilabel" and "top1" not in result and result["n"] == 48
    assert result["map"] > 0.9
    assert result["thresholds"] == read_meta(ml_run / "checkpoints" / "best.safetensors").thresholds
    assert set(result["per_label"]) == set(CLASSES)
    assert all({"ap", "f1", "threshold", "support"} <= set(v) for v in result["per_label"].values())


def test_predict_prints_every_label_above_its_threshold(ml_run, ml_csv, capsys):
    from torchcls.prediction import predict

    files = val_images(ml_csv)
    preds = predict(ml_run, [f for f, _ in files])
    found = [{d["label"] for d in item["labels"]} for item in preds.items]
    assert sum(f == t for f, (_, t) in zip(found, files)) >= 0.85 * len(files)
    assert {"square", "stripe"} in found and set() in found  # several labels, and none
    both = [str(f) for f, t in files if len(t) == 2][:2]
    assert main(["predict", str(ml_run), *both]) == 0
    out = capsys.readouterr().out
    assert out.count("square") >= 2 and out.count("stripe") >= 2


def test_export_onnx_and_serve_give_sigmoid_probabilities(ml_run, ml_csv):
    from fastapi.testclient import TestClient

    from torchcls.artifacts import export, load_artifact
    from torchcls.serve.app import create_app
    from torchcls.serve.serve_config import ServeConfig

    result = export(ml_run, target="onnx")
    artifact = load_artifact(result.path)
    assert artifact.info.task == "multilabel" and len(artifact.info.thresholds) == 2
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(artifact.probabilities(x), artifact(x).sigmoid())
    with TestClient(create_app(artifact, ServeConfig())) as client:
        name = artifact.info.name
        deadline = time.monotonic() + 60
        while client.get("/v2/health/ready").status_code != 200:  # the warm-up runs in the batcher's thread
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        assert client.get(f"/v2/models/{name}").json()["parameters"]["task"] == "multilabel"
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.flatten().tolist()}]}
        answer = client.post(f"/v2/models/{name}/infer", json=body)
        assert answer.status_code == 200, answer.text
        outputs = {o["name"]: o for o in answer.json()["outputs"]}
        probs = torch.tensor(outputs["probabilities"]["data"]).view(3, 2)
        torch.testing.assert_close(probs, artifact(x).sigmoid(), atol=1e-5, rtol=1e-5)
        assert all(set(filter(None, s.split(";"))) <= set(CLASSES) for s in outputs["labels"]["data"])
        both = next(f for f, t in val_images(ml_csv) if len(t) == 2)
        answer = client.post("/predict", content=both.read_bytes()).json()["predictions"][0]
        assert {d["label"] for d in answer["labels"]} == {"square", "stripe"}


def test_mixup_on_the_map_style_loader(ml_csv, tmp_path):
    from torchcls.training import train

    cfg = ml_config(ml_csv, tmp_path, "mix", epochs=1, in_memory="off", mixup=0.2)
    record = json.loads((train(cfg).run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["kind"] == "epoch" and 0 <= record["val_map"] <= 1


# -- pieces ------------------------------------------------------------------------------------
def test_thresholds_maximise_f1_and_smoothing_moves_targets_to_half():
    from torchcls.tasks import SmoothedBCE, best_f1_thresholds, multilabel_metrics

    probs = torch.tensor([[0.9, 0.2], [0.7, 0.3], [0.4, 0.6], [0.1, 0.1]])
    targets = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert best_f1_thresholds(probs, targets) == [pytest.approx(0.55), 0.5]  # between 0.7 and 0.4; no positive: 0.5
    m = multilabel_metrics(probs.logit(), targets, ["a", "b"])
    assert m["per_label"]["a"]["ap"] == pytest.approx(1.0) and m["per_label"]["b"]["ap"] is None
    assert m["map"] == pytest.approx(1.0)  # a label without positives does not count
    logits = torch.zeros(1, 2)
    smoothed = SmoothedBCE(0.2)(logits, torch.tensor([[1.0, 0.0]]))
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([[0.9, 0.1]]))
    torch.testing.assert_close(smoothed, expected)


# -- bad input ---------------------------------------------------------------------------------
def test_labels_column_with_multiclass_is_refused(ml_csv, tmp_path, capsys):
    code = main(["train", "--data", str(ml_csv), "--epochs", "1", "--img-size", "32", "--workers", "0",
                 "--out-dir", str(tmp_path), "--name", "mc", "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and "`labels` column" in err and "--task multilabel" in err and "Traceback" not in err
    assert not (tmp_path / "mc").exists()


def test_multilabel_without_labels_column_is_refused(tmp_path, shapes_dir):
    from torchcls.config import DataConfig
    from torchcls.data import build_data

    single = make_multilabel_csv(tmp_path / "single", n_train=8, n_val=4, column="label")
    text = single.read_text().replace(",,", ",square,")  # a `label` column needs a label on every row
    single.write_text(text)
    for source in (single, shapes_dir):
        with pytest.raises(UserError, match="--task multilabel: .*no `labels` column"):
            build_data(DataConfig(source=str(source), task="multilabel", img_size=32), seed=0)
    both = tmp_path / "both.csv"
    both.write_text("path,label,labels\nimg_000.png,square,square\n")
    with pytest.raises(UserError, match="both a 'label' and a 'labels' column"):
        build_data(DataConfig(source=str(both), task="multilabel"), seed=0)
    assert main(["data", "shard", str(make_multilabel_csv(tmp_path / "ml", 4, 2)), "--out", str(tmp_path / "sh")]) == 2
    assert not (tmp_path / "sh").exists()  # shards hold one class per sample

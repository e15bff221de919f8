"""`torchcls export` of an early-exit run: its torch.cond form to AOTInductor, ONNX and ExecuTorch,
parity per exit in parity.json, and `torchcls predict` on each artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_image_folder, tiny_config
from torchcls.models import SmallNet
from torchcls.models.early_exit import CondEarlyExit, build_early_exit, confidence

pytestmark = pytest.mark.slow
TARGETS = ("aoti", "onnx", "executorch")
SUFFIX = {"aoti": ".pt2", "onnx": ".onnx", "executorch": ".pte"}


@pytest.fixture(scope="module")
def ee_run(tmp_path_factory) -> Path:
    from torchcls.training import train

    base = tmp_path_factory.mktemp("ee_export")
    cfg = tiny_config(make_image_folder(base / "shapes", per_class=24), base / "runs", "ee", epochs=3)
    cfg.model.name, cfg.data.val_fraction = "ee/smallnet", 0.5
    cfg.model.exit_threshold = 0.6  # a 2-class model: confidences lie in [0.5, 1]; 0.6 spreads the exits
    return train(cfg).run_dir


@pytest.fixture(scope="module")
def exported(ee_run) -> dict[str, Path]:
    from torchcls.cli import main

    paths = {}
    for target in TARGETS:
        assert main(["export", str(ee_run), "--target", target, "--max-batch", "8", "--parity-images", "40"]) == 0
        paths[target] = ee_run / "export" / f"{target}-fp32" / f"model{SUFFIX[target]}"
        assert paths[target].is_file()
    return paths


@pytest.mark.parametrize("target", TARGETS)
def test_export_reports_parity_per_exit(exported, target):
    from torchcls.artifacts import load_artifact
    from torchcls.artifacts.edge import describe

    parity = json.loads((exported[target].parent / "parity.json").read_text())
    assert parity["passed"] and parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 1e-3
    ee = parity["early_exit"]
    assert ee["threshold"] == 0.6 and len(ee["exits"]) == 3
    counts = [e["images"] for e in ee["exits"]]
    assert sum(counts) == parity["n"]
    assert ee["never_taken"] == [k for k, c in enumerate(counts) if c == 0]
    assert ("note" in ee) == bool(ee["never_taken"])
    assert sum(c > 0 for c in counts) >= 2  # the threshold makes at least two exits real on these images
    # Where the pool had images for an exit, the selection took some.
    assert all(c > 0 for c, pool in zip(counts, ee["pool_exit_counts"]) if pool > 0)
    for entry in ee["exits"]:
        if entry["images"]:
            assert entry["top1_agreement"] == 1.0 and entry["exit_agreement"] == 1.0
            assert entry["max_abs_diff"] < 1e-3
    art = load_artifact(exported[target])
    assert art.info.exits == 3 and art.info.target == target
    text = describe(parity)  # what `torchcls export` prints after its common line
    assert "exit 0:" in text and ("never taken" in text) == bool(ee["never_taken"])


@pytest.mark.parametrize("target", TARGETS)
def test_predict_on_each_artifact_equals_eager(exported, ee_run, target, capsys):
    from torchcls.checkpoint.files import load_model
    from torchcls.cli import main
    from torchcls.data import build_transform
    from torchcls.data.images import load_image

    images = sorted((ee_run.parent.parent / "shapes").rglob("*.png"))[::5][:10]
    assert main(["predict", str(exported[target]), *map(str, images), "--json"]) == 0
    preds = json.loads(capsys.readouterr().out)["predictions"]
    model, meta = load_model(ee_run)
    tf = build_transform(meta.preprocess, train=False)
    with torch.no_grad():
        probs = model.eval()(torch.stack([tf(load_image(f, 3)) for f in images])).softmax(1)
    assert len(preds) == len(images)
    for item, p in zip(preds, probs):
        assert item["top"][0]["label"] == meta.classes[int(p.argmax())]
        assert abs(item["top"][0]["prob"] - float(p.max())) < 1e-3


def test_plain_artifact_has_no_exits(trained_run, tmp_path):
    from torchcls.artifacts import export, load_artifact
    from torchcls.errors import UserError

    result = export(trained_run, target="onnx", max_batch=4, parity_images=8, out=tmp_path)
    art = load_artifact(result.path)
    assert art.info.exits == 0 and "early_exit" not in result.parity
    with pytest.raises(UserError, match="not an early-exit model"):
        art.with_exits(torch.zeros(1, 3, 32, 32))


def test_compile_fullgraph_matches_eager_on_both_branches():
    """The cond form under torch.compile: batches that all leave at exit 0, and batches that go deeper."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = build_early_exit("smallnet", SmallNet(3, 1, width=4), 3, 0, 0.5).eval()
    x = torch.randn(64, 1, 12, 12) * torch.linspace(0.2, 4, 64)[:, None, None, None]
    with torch.no_grad():
        conf = confidence(model.all_exits(x)[0])
    model.threshold = float(conf.median())
    order = conf.argsort()
    old = inductor_config.layout_optimization
    inductor_config.layout_optimization = False  # cond + convolutions: see artifacts.targets.aoti
    try:
        with torch.no_grad():
            compiled = torch.compile(CondEarlyExit(model), fullgraph=True, dynamic=False)
            for batch in (x[order[-2:]], x[order[:2]]):
                logits, index = model.dynamic(batch)
                got = compiled(batch)
                assert torch.equal(got[1].long(), index) and torch.allclose(got[0], logits, atol=1e-4)
    finally:
        inductor_config.layout_optimization = old


def test_serve_answers_with_an_early_exit_artifact(exported, ee_run):
    """`torchcls serve` on the early-exit .pte: OIP inference gives the eager model's logits."""
    httpx = pytest.importorskip("httpx")
    from test_serve import Server, infer_body, preprocessed
    from torchcls.checkpoint.files import load_model

    files = sorted((ee_run.parent.parent / "shapes").rglob("*.png"))[::7][:5]
    x = preprocessed(ee_run, files)
    model, _ = load_model(ee_run)
    with torch.no_grad():
        expected = model.eval()(x)
    server = Server(exported["executorch"], "--max-wait-ms", "50")
    try:
        r = httpx.post(f"{server.url}/v2/models/ee/infer", json=infer_body(x), timeout=60)
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        torch.testing.assert_close(torch.tensor(out["logits"]["data"]).reshape(5, 2), expected, atol=1e-4, rtol=1e-4)
    finally:
        assert server.stop() == 0


def test_early_exit_export_refuses_what_it_cannot_verify(ee_run, tmp_path):
    from torchcls.artifacts import export
    from torchcls.errors import UserError

    with pytest.raises(UserError, match="fp32 only"):
        export(ee_run, target="aoti", precision="bf16", out=tmp_path)
    with pytest.raises(UserError, match="fp32 only"):
        export(ee_run, target="executorch", quantize="int8", out=tmp_path)
    assert not list(tmp_path.iterdir())

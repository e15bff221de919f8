"""`torchcls serve` of exported artifacts end to end: an AOTInductor `.pt2` and an `.onnx`, each served by a
real server process on 127.0.0.1, answer OIP infer and /predict as the eager model does."""

from __future__ import annotations

import pytest
import torch

from test_serve import Server, images_of, infer_body, preprocessed
from torchcls.checkpoint.files import load_model

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["pt2", "onnx"])
def test_an_exported_artifact_serves_what_eager_computes(kind, request, trained_run):
    # The session's exports (conftest's aoti_export, onnx_path); the .pt2 was made on this machine: its trust
    # decision needs no flag.
    artifact = request.getfixturevalue("aoti_export").path if kind == "pt2" else request.getfixturevalue("onnx_path")
    model, meta = load_model(trained_run)
    sample = images_of(trained_run)[::10][:6]
    x = preprocessed(trained_run, [f for f, _ in sample])
    with torch.no_grad():
        expected = model(x)
    server = Server(artifact, "--max-batch", "8", "--max-wait-ms", "20")
    try:
        md = httpx.get(f"{server.url}/v2/models/shapes").json()
        assert md["parameters"]["classes"] == meta.classes
        r = httpx.post(f"{server.url}/v2/models/shapes/infer", json=infer_body(x))
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        torch.testing.assert_close(torch.tensor(out["logits"]["data"]).reshape(len(sample), 2), expected,
                                   atol=1e-3, rtol=1e-3)
        files = [("file", (f.name, f.read_bytes(), "image/png")) for f, _ in sample]
        r = httpx.post(f"{server.url}/predict?topk=1", files=files)
        assert r.status_code == 200, r.text
        got = [p["top"][0]["label"] for p in r.json()["predictions"]]
        assert got == [meta.classes[i] for i in expected.argmax(1).tolist()]
        too_big = infer_body(torch.zeros(9, *x.shape[1:]))  # the artifact's own batch bound (8)
        assert httpx.post(f"{server.url}/v2/models/shapes/infer", json=too_big).status_code == 400
    finally:
        assert server.stop() == 0

"""predict decodes a batch at a time: at most batch_size transformed images are held before the model sees them
(each is 4 x C x H x W bytes whatever the file's size: 602 KB for a 1x1 PNG at 224 px), never one per input.
The output order, the skipped files and the --on-bad-file error are as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchcls import prediction
from torchcls.data.images import BadImage
from torchcls.errors import UserError


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """A checkpoint loader, image decoder and transform that log what happens, in order."""
    from torchcls.provenance import sidecars

    events: list[str] = []

    class Model(torch.nn.Module):
        def forward(self, x):
            events.append(f"forward {x.shape[0]}")
            return torch.stack([x.mean(dim=(1, 2, 3)), -x.mean(dim=(1, 2, 3))], dim=1)

    meta = SimpleNamespace(preprocess=SimpleNamespace(channels=1, resize_size=4), classes=["hi", "lo"],
                           task="multiclass")

    def load_image(f, channels, size):
        if "bad" in f.name:
            raise BadImage("not an image")
        return int(f.name[:2]) - 5.5  # "lo" for the negative values, "hi" for the positive

    def transform(value):
        events.append("decode")
        return torch.full((1, 4, 4), value)

    monkeypatch.setattr(sidecars, "refuse_forbidden_predictions", lambda *a: None)
    monkeypatch.setattr(sidecars, "check_pinned_sha256", lambda *a: None)
    monkeypatch.setattr(prediction, "load_model", lambda c: (Model(), meta))
    monkeypatch.setattr(prediction, "eager_model", lambda m, meta, p, d: (m, SimpleNamespace(line=lambda: "fp32")))
    monkeypatch.setattr(prediction, "build_transform", lambda pre, train: transform)
    monkeypatch.setattr(prediction, "load_image", load_image)
    files = []
    for i in range(10):
        files.append(tmp_path / f"{i:02d}-{'bad' if i == 6 else 'img'}.png")
        files[-1].write_bytes(b"x")
    return events, files


def test_images_are_decoded_a_batch_at_a_time(fake_model):
    events, files = fake_model
    out = prediction.predict("m.safetensors", [str(f) for f in files], topk=1, on_bad_file="skip", batch_size=4)
    assert events == ["decode"] * 4 + ["forward 4"] + ["decode"] * 4 + ["forward 4"] + ["decode"] + ["forward 1"]
    assert [i["file"] for i in out.items] == [str(f) for f in files if "bad" not in f.name]  # input order
    assert [i["top"][0]["label"] for i in out.items] == ["lo"] * 6 + ["hi"] * 3
    assert out.skipped == [{"file": str(files[6]), "reason": "not an image"}]


def test_a_bad_file_is_still_an_error_when_asked(fake_model):
    _, files = fake_model
    with pytest.raises(UserError, match="06-bad.png: not an image \\(pass --on-bad-file skip"):
        prediction.predict("m.safetensors", [str(f) for f in files], on_bad_file="error", batch_size=4)
    with pytest.raises(UserError, match="batch size 0"):
        prediction.predict("m.safetensors", [str(f) for f in files], batch_size=0)

"""Local pretrained weights: torchcls checkpoints, timm/torchvision state dicts, hub folders; refusals."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchcls.checkpoint.pretrained import load_pretrained, read_state_dict
from torchcls.errors import UserError
from torchcls.models import ModelSpec, create_model


def test_torchcls_run_into_other_classes_and_channels(trained_run: Path) -> None:
    # trained_run: SmallNet, 2 classes, RGB. Target: 5 classes, grey.
    source = read_state_dict(trained_run)
    model = create_model(ModelSpec("smallnet", 5, 1, 28))
    report = load_pretrained(model, trained_run, num_classes=5)
    assert report.reinitialised and all(k.startswith("head.") for k in report.reinitialised)
    assert report.adapted == ["stem.0.weight"]
    assert report.loaded == len(model.state_dict()) - len(report.reinitialised) and not report.unexpected
    state = model.state_dict()
    middle = next(k for k in source if k.startswith("stages.") and k.endswith("weight"))
    torch.testing.assert_close(state[middle], source[middle])
    # Grey from RGB: timm's adapt_input_conv sums the colour filters.
    torch.testing.assert_close(state["stem.0.weight"], source["stem.0.weight"].sum(1, keepdim=True))
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 5)


def test_a_head_for_as_many_other_classes_is_reinitialised(trained_run: Path) -> None:
    """Two classes again, but other ones: the trained head's rows would name the wrong classes."""
    from torchcls.checkpoint.files import read_meta

    trained = read_meta(next((trained_run / "checkpoints").glob("best.safetensors"))).classes
    source = read_state_dict(trained_run)
    same = create_model(ModelSpec("smallnet", 2, 3, 28))
    assert not load_pretrained(same, trained_run, 2, classes=list(trained)).reinitialised
    torch.testing.assert_close(same.state_dict()["head.3.weight"], source["head.3.weight"])
    other = create_model(ModelSpec("smallnet", 2, 3, 28))
    report = load_pretrained(other, trained_run, 2, classes=["cat", "dog"])
    assert sorted(report.reinitialised) == ["head.3.bias", "head.3.weight"]
    assert not torch.equal(other.state_dict()["head.3.weight"], source["head.3.weight"])


def test_timm_state_dict_pth_and_hub_folder(tmp_path: Path) -> None:
    import timm

    original = timm.create_model("resnet18", pretrained=False, num_classes=1000)
    pth = tmp_path / "resnet18.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in original.state_dict().items()}, "epoch": 3}, pth)
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file(original.state_dict(), str(hub / "model.safetensors"))
    (hub / "config.json").write_text('{"architecture": "resnet18", "num_classes": 1000}')
    with pytest.raises(UserError, match="is a pickle .* --unsafe-unpickle"):  # not read by default
        load_pretrained(create_model(ModelSpec("resnet18", 10, 3, 64)), pth, num_classes=10)
    for path in (pth, hub):
        model = create_model(ModelSpec("resnet18", 10, 3, 64))
        report = load_pretrained(model, path, num_classes=10, unsafe_unpickle=path == pth)
        assert sorted(report.reinitialised) == ["fc.bias", "fc.weight"] and report.missing == []
        torch.testing.assert_close(model.state_dict()["layer4.1.conv2.weight"],
                                   original.state_dict()["layer4.1.conv2.weight"])


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    with evil.open("wb") as f:
        pickle.dump({"state_dict": {"w": _Exploit(marker)}}, f)
    for opted_in in (False, True):  # by default not even the restricted unpickler reads it
        with pytest.raises(UserError, match="refused" if opted_in else "--unsafe-unpickle"):
            load_pretrained(create_model(ModelSpec("smallnet", 2, 1, 28)), evil, num_classes=2, unsafe_unpickle=opted_in)
    assert not marker.exists()


def test_other_architecture_names_the_keys(tmp_path: Path) -> None:
    import timm

    path = tmp_path / "r18.safetensors"
    save_file(timm.create_model("resnet18", pretrained=False).state_dict(), str(path))
    with pytest.raises(UserError, match="does not fit this --model.*layer"):
        load_pretrained(create_model(ModelSpec("resnet34", 10, 3, 64)), path, num_classes=10)
    with pytest.raises(UserError, match="does not exist"):
        load_pretrained(create_model(ModelSpec("smallnet", 2, 1, 28)), tmp_path / "nope.pth", num_classes=2)


def _three_class_folder(root: Path, per_class: int) -> Path:
    """Another data set: different class names and one class more than the shapes run."""
    from PIL import Image

    from conftest import draw_shape

    for name, kind in (("ring", "circle"), ("block", "square"), ("blank", None)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            im = draw_shape(kind, 32, seed=7_000 + i) if kind else Image.new("RGB", (32, 32), (i * 5 % 80, 20, 40))
            im.save(root / name / f"{i:03d}.png")
    return root


@pytest.mark.slow
def test_fine_tuning_beats_scratch_on_a_small_set(trained_run: Path, tmp_path: Path) -> None:
    import json

    from conftest import tiny_config
    from torchcls.training import train

    data = _three_class_folder(tmp_path / "three", per_class=12)
    results = {}
    for name, pretrained in (("scratch", None), ("tuned", str(trained_run))):
        cfg = tiny_config(data, tmp_path / "runs", name, epochs=2)
        cfg.model.pretrained, cfg.optim.lr, cfg.governance.lineage = pretrained, 1e-3, False
        results[name] = train(cfg)
    report = json.loads((results["tuned"].run_dir / "pretrained.json").read_text())
    assert report["reinitialised"] and report["loaded"] > 20 and not report["missing"]
    assert results["tuned"].val_top1 > results["scratch"].val_top1, {k: r.val_top1 for k, r in results.items()}

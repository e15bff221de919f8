"""Local pretrained weights: torchcls checkpoints, timm/torchvision state dicts, hub folders; refusals."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchcls.checkpoint.pretrained import load_pretrained, pretrained_model, read_state_dict
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
    """timm loads them (timm.create_model(pretrained=True, pretrained_cfg_overlay=dict(file=...))): every
    tensor but the classifier is the file's, bit for bit; a DDP prefix and a training script's wrapper go."""
    import timm

    original = timm.create_model("resnet18", pretrained=False, num_classes=1000).state_dict()
    pth = tmp_path / "resnet18.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in original.items()}, "epoch": 3}, pth)
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file(original, str(hub / "model.safetensors"))
    (hub / "config.json").write_text('{"architecture": "resnet18", "num_classes": 1000}')
    spec = ModelSpec("resnet18", 10, 3, 64)
    with pytest.raises(UserError, match="is a pickle .* --unsafe-unpickle"):  # not read by default
        pretrained_model(spec, pth)
    for path in (pth, hub):
        model, report = pretrained_model(spec, path, unsafe_unpickle=path == pth)
        assert sorted(report.reinitialised) == ["fc.bias", "fc.weight"] and report.missing == []
        state = model.state_dict()
        assert report.loaded == len(original) - 2 and state["fc.weight"].shape == (10, 512)
        assert all(torch.equal(state[k], v) for k, v in original.items() if not k.startswith("fc."))


@pytest.mark.parametrize("pretrained_cfg, field", [
    ({"input_size": [3, 224, 224], "crop_pct": 0.001}, "crop_pct"),  # resize side 224,000 px
    ({"input_size": [3, 224, 224], "crop_pct": -1}, "crop_pct"),  # a negative resize side
    ({"input_size": [3, 40000, 40000]}, "input_size"),
    ({"input_size": [3, 224, 40000]}, "input_size width"),
    ({"input_size": [10**6, 224, 224], "mean": [0.5] * 3, "std": [0.5] * 3}, "input_size channels"),
    ({"mean": [0.5, 0.5]}, "mean and std"),
    ({"std": [0.5, 0.0, 0.5]}, "mean and std"),
    ({"mean": [1e300] * 3}, "mean and std"),
], ids=["crop-tiny", "crop-negative", "side-40000", "width-40000", "channels", "mean-2", "std-0", "mean-huge"])
def test_a_hub_folders_config_is_held_to_the_checkpoint_bounds(tmp_path: Path, pretrained_cfg, field) -> None:
    """Review 3, finding 2: a hub folder's (or hub repository's) config.json set crop_pct and input_size
    unchecked (crop_pct 0.001: each image resized to 224,000 px). The same bounds as checkpoint metadata
    (data/preprocess.check_input) now hold, with an error naming the folder and the field."""
    import json

    from torchcls.checkpoint.pretrained import resolve_pretrained

    folder = tmp_path / "hubfolder"
    folder.mkdir()
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": "resnet18", "pretrained_cfg": pretrained_cfg}))
    with pytest.raises(UserError, match=f"--pretrained {folder}: its pretrained config's {field} must") as refused:
        resolve_pretrained(str(folder), "smallnet")
    assert "\n" not in str(refused.value)
    (folder / "config.json").write_text(json.dumps({"architecture": "resnet18", "pretrained_cfg": {
        "input_size": [3, 40, 48], "crop_pct": 0.8, "interpolation": "lanczos", "mean": [0.3] * 3, "std": [0.2] * 3}}))
    given = resolve_pretrained(str(folder), "smallnet").input  # a config in the bounds reads as before
    assert (given.img_size, given.crop_pct, given.mean, given.std, given.interpolation) == (
        48, 0.8, (0.3,) * 3, (0.2,) * 3, "lanczos")


@pytest.mark.parametrize("config, field", [
    ({"model_args": {"in_chans": 3}, "pretrained_cfg": {"input_size": 7}}, "pretrained_cfg.input_size"),
    ({"pretrained_cfg": {"input_size": "224"}}, "pretrained_cfg.input_size"),
    ({"pretrained_cfg": {"input_size": [3, "224", 224]}}, "pretrained_cfg.input_size.1"),
    ({"model_args": {"in_chans": "3"}, "pretrained_cfg": {}}, "model_args.in_chans"),
    ({"model_args": [3], "pretrained_cfg": {}}, "model_args"),
    ({"num_classes": "1000", "pretrained_cfg": {}}, "num_classes"),
    ({"num_classes": True, "pretrained_cfg": {}}, "num_classes"),
    ({"input_size": {"c": 3}}, "input_size"),  # timm < 0.9's flat config
], ids=["int-input-size-with-in-chans", "str-input-size", "str-side", "str-in-chans", "list-model-args",
        "str-classes", "bool-classes", "flat-dict-input-size"])
def test_a_hub_folders_config_of_other_types_is_refused_naming_the_field(tmp_path: Path, config, field) -> None:
    """Review 4, finding 5: `input_size: 7` beside model_args.in_chans was a TypeError (`int` is not iterable)
    before any bound was checked. Every field read of a timm config is now typed first (models/hub.TimmConfig)."""
    import json

    from torchcls.checkpoint.pretrained import resolve_pretrained

    folder = tmp_path / "hubfolder"
    folder.mkdir()
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": "resnet18", **config}))
    with pytest.raises(UserError, match=rf"--pretrained {folder}: {folder / 'config.json'}: {re.escape(field)}: "
                                        r".*, not what timm writes$"):
        resolve_pretrained(str(folder), "smallnet")


def test_timm_model_from_a_torchcls_checkpoint_keeps_or_renews_its_head(tmp_path: Path) -> None:
    """A torchcls checkpoint of a timm model goes through timm too: same classes keep the trained head (all
    tensors the file's), other classes of the same count get a new one (timm's reset_classifier)."""
    import timm

    trained = timm.create_model("test_resnet", num_classes=2, in_chans=1).state_dict()
    file = tmp_path / "grey.safetensors"
    save_file(trained, str(file))
    model, report = pretrained_model(ModelSpec("test_resnet", 2, 1, 32), file)
    assert not report.reinitialised and not report.adapted and report.loaded == len(trained)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    rgb, report = pretrained_model(ModelSpec("test_resnet", 5, 3, 32), file)  # the grey stem repeated for RGB
    assert report.adapted == ["conv1.0.weight"] and sorted(report.reinitialised) == ["fc.bias", "fc.weight"]
    assert rgb.state_dict()["conv1.0.weight"].shape[1] == 3 and rgb(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_a_safetensors_header_is_bounded_before_timm_reads_it(tmp_path: Path) -> None:
    """A header that claims more bytes than the file has, and a pickle named .safetensors: refused, naming the
    user's file (not the link timm is handed); the pickle is never unpickled (timm picks safetensors by name)."""
    import struct

    crafted = tmp_path / "big.safetensors"
    crafted.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(UserError, match=f"{crafted}: its safetensors header claims"):
        pretrained_model(ModelSpec("test_resnet", 2, 3, 32), crafted)
    marker = tmp_path / "pwned"
    disguised = tmp_path / "evil.safetensors"
    with disguised.open("wb") as f:
        pickle.dump({"conv1.0.weight": _Exploit(marker)}, f)
    with pytest.raises(UserError, match=str(disguised)):
        pretrained_model(ModelSpec("test_resnet", 2, 3, 32), disguised, unsafe_unpickle=True)
    assert not marker.exists()


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
        for spec in (ModelSpec("smallnet", 2, 1, 28), ModelSpec("test_resnet", 2, 1, 28)):  # ours, timm's
            with pytest.raises(UserError, match="refused" if opted_in else "--unsafe-unpickle"):
                pretrained_model(spec, evil, unsafe_unpickle=opted_in)
    assert not marker.exists()


def test_other_architecture_names_the_keys(tmp_path: Path) -> None:
    import timm

    path = tmp_path / "r18.safetensors"
    save_file(timm.create_model("resnet18", pretrained=False).state_dict(), str(path))
    with pytest.raises(UserError, match="does not fit this --model resnet34 .*Missing key.*layer1.2"):
        pretrained_model(ModelSpec("resnet34", 10, 3, 64), path)  # resnet18's tensors all fit: resnet34 has more
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

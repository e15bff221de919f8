"""Pretrained backbones from the Hugging Face hub, offline: a hub cache built here in the hub's own
layout (models--ORG--NAME/snapshots/<commit>/, refs/main), HF_HUB_OFFLINE=1, tiny timm models.

What a user sees: `torchcls train --pretrained hf-hub:ORG/NAME` fine-tunes from the cached weights
(the backbone tensors are the cached ones), the input follows the hub config (size, mean/std,
interpolation, crop) into the checkpoint, predict and export metadata; `--model NAME.TAG
--pretrained` takes the tag's weights from timm's registry; a pickle on the hub is refused; a
missing cache is one line naming the cache and the offline switch; `torchcls models` lists tags.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchcls.errors import UserError

REVISION = "0123456789abcdef0123456789abcdef01234567"  # any 40 hex digits: the snapshot (commit) folder
HUB_INPUT = {"input_size": (3, 40, 40), "crop_pct": 0.8, "interpolation": "bicubic", "mean": (0.3, 0.4, 0.5),
             "std": (0.2, 0.25, 0.3)}  # a config no default would give: each value traceable to the hub


def _put_in_cache(hub: Path, repo_id: str, files: Path) -> Path:
    """Place `files` as the main revision of `repo_id` in the hub cache `hub` (huggingface_hub's layout)."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for f in files.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """An HF_HOME whose hub cache holds three repositories:
    tiny-org/test-convnext: test_convnext with HUB_INPUT as its pretrained config, model.safetensors;
    timm/test_resnet.r160_in1k: what timm's registry names for that tag, as pytorch_model.bin (a pickle
    of tensors only); evil-org/pickle: a config.json and a pytorch_model.bin that runs code when unpickled."""
    import timm
    from timm.models import save_for_hf

    home = tmp_path_factory.mktemp("hf_home")
    made = home.parent / f"{home.name}-made"
    convnext = timm.create_model("test_convnext", pretrained_cfg_overlay=HUB_INPUT)
    save_for_hf(convnext, made / "convnext", safe_serialization=True)
    _put_in_cache(home / "hub", "tiny-org/test-convnext", made / "convnext")
    resnet = timm.create_model("test_resnet.r160_in1k")
    save_for_hf(resnet, made / "resnet", safe_serialization=False)
    _put_in_cache(home / "hub", "timm/test_resnet.r160_in1k", made / "resnet")
    evil = made / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((made / "resnet" / "config.json").read_text())
    marker = home / "pwned"
    with (evil / "pytorch_model.bin").open("wb") as f:
        pickle.dump({"conv1.weight": _Exploit(marker)}, f)
    _put_in_cache(home / "hub", "evil-org/pickle", evil)
    return home


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def offline_hub(hf_home: Path, monkeypatch) -> Path:
    """This process reads `hf_home`'s cache with the network off (huggingface_hub reads its constants
    at call time; the environment is for the processes a test starts)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home / "hub"


def _cli(*args, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchcls", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


@pytest.mark.slow
def test_fine_tune_from_the_hub_offline_carries_its_preprocessing(offline_hub: Path, tmp_path: Path) -> None:
    from conftest import make_image_folder
    from torchcls.artifacts.artifact import load_artifact
    from torchcls.checkpoint.files import read_meta

    data = make_image_folder(tmp_path / "shapes", per_class=8, size=48)
    env = {"HF_HOME": str(offline_hub.parent), "HF_HUB_OFFLINE": "1"}
    r = _cli("train", "--data", data, "--pretrained", "hf-hub:tiny-org/test-convnext", "--freeze", "backbone",
             "--epochs", 1, "--batch-size", 8, "--workers", 0, "--precision", "fp32", "--out-dir", tmp_path,
             "--name", "hub", "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "hub"
    assert ("preprocess: 40 px, bicubic resize to 50 + centre crop (crop_pct 0.8), mean/std 0.3,0.4,0.5/0.2,0.25,0.3 "
            "(channels from the data; img_size, mean_std, interpolation, crop_pct from the pretrained config "
            "(hf-hub:tiny-org/test-convnext))") in r.stdout
    assert 'name = "test_convnext"' in (run / "config.toml").read_text()  # --model from the hub config
    report = json.loads((run / "pretrained.json").read_text())
    assert report["hub"] == {"repo_id": "tiny-org/test-convnext", "revision": REVISION,
                             "cache": str(offline_hub / "models--tiny-org--test-convnext")}
    assert sorted(report["reinitialised"]) == ["head.fc.bias", "head.fc.weight"] and not report["missing"]
    # The backbone was frozen: its tensors in the trained checkpoint are the cached ones, bit for bit.
    cached = load_file(offline_hub / "models--tiny-org--test-convnext" / "snapshots" / REVISION / "model.safetensors")
    trained = load_file(run / "checkpoints" / "best.safetensors")
    backbone = [k for k in cached if not k.startswith("head.fc.")]
    assert len(backbone) == report["loaded"] > 20
    assert all(torch.equal(trained[k], cached[k]) for k in backbone)
    # The input follows the hub config, into the run, the checkpoint and what predict and export read.
    expected = {"img_size": 40, "channels": 3, "mean": [0.3, 0.4, 0.5], "std": [0.2, 0.25, 0.3],
                "interpolation": "bicubic", "crop_pct": 0.8}
    recorded = json.loads((run / "preprocess.json").read_text())
    assert recorded["preprocess"] == expected and recorded["from"]["mean_std"].startswith("the pretrained config")
    assert read_meta(run / "checkpoints" / "best.safetensors").preprocess.__dict__ == {
        k: tuple(v) if isinstance(v, list) else v for k, v in expected.items()}
    r = _cli("export", run, "--target", "onnx", "--parity-images", 8, "--precision", "fp32", env=env)
    assert r.returncode == 0, r.stderr
    onnx = next((run / "export").rglob("model.onnx"))
    assert load_artifact(onnx).info.preprocess == read_meta(run / "checkpoints" / "best.safetensors").preprocess
    r = _cli("predict", onnx, data / "circle", "--json", env=env)
    assert r.returncode == 0 and len(json.loads(r.stdout)["predictions"]) == 8, r.stderr


def test_bare_flag_takes_the_tags_weights_from_a_bin_with_weights_only(offline_hub: Path) -> None:
    from torchcls.checkpoint.pretrained import model_for, pretrained_model, resolve_pretrained
    from torchcls.cli import build_parser
    from torchcls.models import ModelSpec
    from torchcls.options import config_from_args

    argv = ["train", "--model", "test_resnet.r160_in1k", "--pretrained", "--epochs", "1"]
    assert config_from_args(build_parser().parse_args(argv)).model.pretrained == "hub"  # the flag alone
    source = resolve_pretrained("hub", "test_resnet.r160_in1k")
    assert source.file.name == "pytorch_model.bin" and source.hub["repo_id"] == "timm/test_resnet.r160_in1k"
    pre = source.input  # timm's registry config of the tag: 160 px, crop 0.95, mean/std 0.5
    assert (pre.img_size, pre.crop_pct, pre.mean, pre.interpolation) == (160, 0.95, (0.5, 0.5, 0.5), "bilinear")
    assert model_for("test_resnet.r160_in1k", source, default="smallnet") == "test_resnet.r160_in1k"
    spec = ModelSpec("test_resnet.r160_in1k", 3, 1, 64)  # other classes, grey
    with pytest.raises(UserError, match="pickles are not read by default.*--unsafe-unpickle"):
        pretrained_model(spec, source)  # a .bin is a pickle: only with the opt-in
    model, report = pretrained_model(spec, source, unsafe_unpickle=True)
    cached = torch.load(source.file, weights_only=True)
    assert report.adapted == ["conv1.0.weight"] and sorted(report.reinitialised) == ["fc.bias", "fc.weight"]
    state = model.state_dict()  # every other tensor is the file's, bit for bit; the grey stem sums its RGB filters
    assert all(torch.equal(state[k], v) for k, v in cached.items() if k not in report.adapted + report.reinitialised)
    torch.testing.assert_close(state["conv1.0.weight"], cached["conv1.0.weight"].sum(1, keepdim=True))
    assert report.loaded == len(state) - 2 and model(torch.randn(2, 1, 64, 64)).shape == (2, 3)
    with pytest.raises(UserError, match="'smallnet' has none"):
        resolve_pretrained("hub", "smallnet")


def test_a_pickle_on_the_hub_is_refused_and_never_run(offline_hub: Path, hf_home: Path) -> None:
    from torchcls.checkpoint.pretrained import pretrained_model
    from torchcls.models import ModelSpec

    spec = ModelSpec("test_resnet", 2, 3, 32)
    with pytest.raises(UserError, match="pickles are not read by default"):
        pretrained_model(spec, "hf-hub:evil-org/pickle")  # by default a pickle is not even opened
    with pytest.raises(UserError, match="refused, it needs unpickling"):  # opted in: torch's restricted unpickler
        pretrained_model(spec, "hf-hub:evil-org/pickle", unsafe_unpickle=True)
    assert not (hf_home / "pwned").exists()


def test_a_repository_of_another_library_or_a_bad_id_is_one_clear_error(offline_hub: Path, tmp_path: Path) -> None:
    """A transformers repository (config.json with "architectures", not timm's "architecture") and a name the
    hub refuses are user mistakes of the first hour: a UserError naming the fix, not a traceback."""
    from torchcls.checkpoint.pretrained import resolve_pretrained

    made = tmp_path / "vit"
    made.mkdir()
    (made / "config.json").write_text('{"architectures": ["ViTForImageClassification"], "model_type": "vit"}')
    (made / "model.safetensors").write_bytes(b"")
    _put_in_cache(offline_hub, "google/vit-base-patch16-224", made)
    with pytest.raises(UserError, match="is not a timm model config.*hf-hub:timm/"):
        resolve_pretrained("hf-hub:google/vit-base-patch16-224", "resnet18")
    with pytest.raises(UserError, match="--pretrained hf-hub:timm/a..b: "):
        resolve_pretrained("hf-hub:timm/a..b", "resnet18")


def test_hub_architecture_and_position_embeddings(offline_hub: Path, tmp_path: Path) -> None:
    """--model of another family is refused before anything is read; a ViT's position embeddings are
    resampled to another input size (timm's checkpoint_filter_fn), as timm's own loader does."""
    import timm
    from timm.models import save_for_hf

    from torchcls.checkpoint.pretrained import model_for, pretrained_model, resolve_pretrained
    from torchcls.models import ModelSpec

    source = resolve_pretrained("hf-hub:tiny-org/test-convnext", "smallnet")
    assert model_for("smallnet", source, default="smallnet") == "test_convnext"
    with pytest.raises(UserError, match="holds weights of test_convnext, but --model is resnet18"):
        model_for("resnet18", source, default="smallnet")
    vit = timm.create_model("test_vit")  # 160 px: 10x10 patches + a class token
    save_for_hf(vit, tmp_path / "vit", safe_serialization=True)
    _put_in_cache(offline_hub, "tiny-org/test-vit", tmp_path / "vit")
    small, report = pretrained_model(ModelSpec("test_vit", 2, 3, 32), "hf-hub:tiny-org/test-vit")  # 2x2 patches
    assert small.pos_embed.shape[1] == 5 and "pos_embed" not in report.missing
    torch.testing.assert_close(small.state_dict()["blocks.0.attn.qkv.weight"], vit.state_dict()["blocks.0.attn.qkv.weight"])


def test_flags_override_the_hub_config_and_the_run_says_so(offline_hub: Path) -> None:
    from types import SimpleNamespace

    from torchcls.checkpoint.pretrained import resolve_pretrained
    from torchcls.config import DataConfig
    from torchcls.data.preprocess import resolve_preprocess

    hub_input = resolve_pretrained("hf-hub:tiny-org/test-convnext", "smallnet").input
    photos = SimpleNamespace(name="photos", channels=3, side=None)
    pre, chosen = resolve_preprocess(DataConfig(img_size=64), photos, hub_input)
    assert (pre.img_size, pre.resize_size, pre.mean, pre.interpolation) == (64, 80, (0.3, 0.4, 0.5), "bicubic")
    assert chosen["img_size"] == "--img-size (the pretrained config says 40)"
    assert chosen["mean_std"] == "the pretrained config (hf-hub:tiny-org/test-convnext)"
    pre, chosen = resolve_preprocess(DataConfig(), photos)  # no backbone config: as before
    assert (pre.img_size, pre.interpolation, pre.crop_pct, pre.mean) == (224, "bilinear", 1.0, (0.485, 0.456, 0.406))


@pytest.mark.slow
def test_missing_weights_offline_is_one_line_naming_the_cache_and_the_switch(tmp_path: Path, shapes_dir) -> None:
    env = {"HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    r = _cli("train", "--data", shapes_dir, "--pretrained", "hf-hub:timm/convnext_tiny.fb_in22k_ft_in1k",
             "--epochs", 1, "--workers", 0, "--out-dir", tmp_path / "runs", "--name", "x", env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    error = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(error) == 1, r.stderr
    assert f"not in the Hugging Face cache {tmp_path / 'empty' / 'hub'}" in error[0]
    assert "HF_HUB_OFFLINE=1 is set" in error[0] and "models--timm--convnext_tiny.fb_in22k_ft_in1k/" in error[0]
    assert not (tmp_path / "runs" / "x").exists()


def test_models_lists_names_and_pretrained_tags(offline_hub: Path, capsys) -> None:
    from torchcls.cli import main
    from torchcls.models.catalog import list_models

    names = [e.name for e in list_models("resnet18")]
    assert {"resnet18", "tv/resnet18", "ee/resnet18"} <= set(names)
    assert [e.name for e in list_models("*net")][:3] == ["smallnet", "fastnet", "ee/smallnet"]  # ours first
    assert main(["models", "test_resnet", "--pretrained"]) == 0
    out = capsys.readouterr().out
    assert "test_resnet.r160_in1k" in out and "hf-hub:timm/test_resnet.r160_in1k  [in cache]" in out
    assert main(["models", "test_vit.*", "--pretrained", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"name": "test_vit.r160_in1k", "family": "timm", "pretrained": "hf-hub:timm/test_vit.r160_in1k",
            "cached": False} in listed

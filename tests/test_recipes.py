"""Named recipes (`torchcls train --recipe NAME`) and FastNet, the fmnist-fast recipe's model."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from torchcls.cli import build_parser, main
from torchcls.options import config_from_args
from torchcls.precision.hardware import choose_precision
from torchcls.recipes import describe, load_recipe, names, recipe_evaluation
from torchcls.toml_compat import tomllib

ROOT = Path(__file__).resolve().parents[1]


def train_config(*argv):
    return config_from_args(build_parser().parse_args(["train", *map(str, argv)]))


def test_fmnist_fast_recipe_loads():
    assert "fmnist-fast" in names()
    cfg = load_recipe("fmnist-fast")
    assert (cfg.data.source, cfg.data.val_fraction, cfg.model.name) == ("fashion-mnist", 0.0, "fastnet_lite")
    assert (cfg.optim.optimizer, cfg.precision.precision, cfg.train.channels_last) == ("sgd", "auto", None)
    assert cfg.data.batch_size == 256 and cfg.optim.lr > 0.01  # the recipe's values, not the defaults
    assert (cfg.model.init, cfg.model.freeze_first_conv) == ("whiten", True)
    assert recipe_evaluation("fmnist-fast") == {"tta": "flip"}
    assert "fmnist-fast" in describe() and "94%" in describe()


def test_recipe_is_the_base_config_and_flags_override_it(tmp_path):
    cfg = train_config("--recipe", "fmnist-fast", "--epochs", 3, "--lr", 0.05)
    assert (cfg.train.epochs, cfg.optim.lr) == (3, 0.05)
    assert (cfg.model.name, cfg.optim.optimizer, cfg.data.val_fraction) == ("fastnet_lite", "sgd", 0.0)  # kept
    # --config overrides the recipe, and flags override both.
    (tmp_path / "c.toml").write_text("[optim]\nlr = 0.01\n[train]\nepochs = 2\n[data]\nbatch_size = 64\n")
    cfg = train_config("--recipe", "fmnist-fast", "--config", tmp_path / "c.toml", "--epochs", 4)
    assert (cfg.optim.lr, cfg.train.epochs, cfg.data.batch_size) == (0.01, 4, 64)
    assert (cfg.model.name, cfg.precision.precision) == ("fastnet_lite", "auto")
    # Without --recipe nothing changes: the defaults.
    assert train_config().model.name == "smallnet"


def test_unknown_recipe_is_refused_naming_the_recipes(capsys):
    assert main(["train", "--recipe", "fmnist-fastt"]) == 2
    err = capsys.readouterr().err
    assert "no recipe named 'fmnist-fastt'" in err and "fmnist-fast" in err and "Traceback" not in err


def test_recipe_list_prints_the_recipes(capsys):
    assert main(["train", "--recipe", "list"]) == 0
    assert "fmnist-fast" in capsys.readouterr().out


def test_recipes_ship_with_the_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "recipes/*.toml" in cfg["tool"]["setuptools"]["package-data"]["torchcls"]


def test_fastnet_shape_size_and_downsampling():
    from torchcls.models.registry import ModelSpec, create_model

    model = create_model(ModelSpec("fastnet", num_classes=10, in_chans=1, img_size=28)).eval()
    n = sum(p.numel() for p in model.parameters())
    assert 0.3e6 < n < 1e6
    x = torch.randn(4, 1, 28, 28).to(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).shape == (4, 10)
    # 28 px only in the stem: the first stage already works at 14 px.
    with torch.no_grad():
        assert model.stages[0](model.stem(x)).shape[-2:] == (14, 14)
    rgb = create_model(ModelSpec("fastnet", num_classes=3, in_chans=3, img_size=32))
    assert rgb(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_fastnet_slim_narrows_only_the_28_and_14_px_layers():
    from torchcls.models.catalog import list_models
    from torchcls.models.registry import ModelSpec, create_model, is_timm_name

    spec = ModelSpec("fastnet", num_classes=10, in_chans=1, img_size=28)
    full, slim = create_model(spec), create_model(replace(spec, name="fastnet_slim"))
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert slim.stem(x).shape[1] == 16 and slim.stages[0](slim.stem(x)).shape[1:] == (32, 14, 14)
    assert (full.stage_channels, slim.stage_channels) == ((48, 96, 192), (32, 96, 192))  # 7 and 4 px kept
    assert slim(x).shape == (2, 10)
    size = [sum(p.numel() for p in m.parameters()) for m in (full, slim)]
    assert 0.3e6 < size[1] < size[0]
    assert not is_timm_name("fastnet_slim") and [e.name for e in list_models("fastnet")] == [
        "fastnet", "fastnet_slim", "fastnet_lite"]


def test_fastnet_lite_is_slim_without_the_14_px_residual_block():
    from torchcls.models.fastnet import Residual
    from torchcls.models.registry import ModelSpec, create_model

    spec = ModelSpec("fastnet_slim", num_classes=10, in_chans=1, img_size=28)
    slim, lite = create_model(spec), create_model(replace(spec, name="fastnet_lite"))
    residuals = [[type(m) for m in stage].count(Residual) for stage in lite.stages[:2]]
    assert residuals == [0, 1] and [[type(m) for m in stage].count(Residual) for stage in slim.stages[:2]] == [1, 1]
    assert lite.stage_channels == slim.stage_channels == (32, 96, 192)
    x = torch.randn(2, 1, 28, 28)
    assert lite(x).shape == (2, 10)
    block = sum(p.numel() for p in slim.stages[0][1].parameters())
    assert sum(p.numel() for p in lite.parameters()) == sum(p.numel() for p in slim.parameters()) - block


@pytest.mark.slow
def test_recipe_trains_end_to_end_with_overrides(tmp_path, shapes_dir):
    """The recipe's whole setup (fastnet, SGD, precision auto, in-memory batches) on a tiny set."""
    r = subprocess.run([sys.executable, "-m", "torchcls", "train", "--recipe", "fmnist-fast", "--data",
                        str(shapes_dir), "--val-fraction", "0.25", "--epochs", "1", "--batch-size", "8",
                        "--img-size", "28", "--out-dir", str(tmp_path), "--name", "r", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    saved = tomllib.loads((tmp_path / "r" / "config.toml").read_text())
    assert saved["model"]["name"] == "fastnet_lite" and saved["optim"]["optimizer"] == "sgd"
    assert saved["data"]["batch_size"] == 8 and saved["precision"]["precision"] == "auto"  # as asked
    ran = json.loads((tmp_path / "r" / "precision.json").read_text())  # what auto chose on this machine:
    # the rule's precision, or fp32 where the timed step found it faster than a native bf16 (step_choice.json)
    step = json.loads((tmp_path / "r" / "step_choice.json").read_text())["precision"]["precision"]
    assert ran["requested"] == "auto" and ran["precision"] == step
    assert step in {choose_precision("auto", torch.device("cpu")).precision, "fp32"}


@pytest.mark.parametrize("cpu, expected", [((True, "avx512_bf16 here"), "bf16"), ((False, "AVX2 only"), "fp32")])
def test_fmnist_fast_resolves_auto_from_the_cpu(cpu, expected, monkeypatch):
    """bf16 where the CPU has it natively; fp32 on an AVX2-only CPU, where bf16 trained ~12x slower."""
    from torchcls.models.registry import ModelSpec, create_model
    from torchcls.precision import hardware
    from torchcls.precision.training import apply_precision

    monkeypatch.setattr(hardware, "cpu_bf16_here", lambda: cpu)
    recipe = load_recipe("fmnist-fast")
    model = create_model(ModelSpec("fastnet", num_classes=10, in_chans=1, img_size=28))
    plan = apply_precision(model, recipe.precision, torch.device("cpu"))
    assert (plan.name, plan.report["requested"], plan.report["reason"]) == (expected, "auto", cpu[1])

from pathlib import Path

import pytest

from torchcls.cli import build_parser, config_from_args
from torchcls.config import Config, load_toml
from torchcls.errors import UserError


def test_toml_roundtrip_and_cli_override(tmp_path: Path):
    cfg = Config()
    cfg.model.name, cfg.optim.lr, cfg.data.img_size = "resnet18", 0.01, 64
    path = tmp_path / "c.toml"
    cfg.save_toml(path)
    loaded = load_toml(path)
    assert loaded == cfg

    args = build_parser().parse_args(["train", "--config", str(path), "--lr", "0.5", "--no-progress",
                                      "--model", "smallnet"])
    merged = config_from_args(args)
    assert merged.optim.lr == 0.5 and merged.model.name == "smallnet" and merged.train.progress is False
    assert merged.data.img_size == 64  # from the file, not overridden


@pytest.mark.parametrize("text, message", [
    ("[optim]\nlr = 'fast'\n", "lr must be float"),
    ("[optim]\nlearning_rate = 0.1\n", "unknown option 'learning_rate'"),
    ("[nope]\nx = 1\n", "unknown section [nope]"),
    ("[train]\nprecision = 'fp64'\n", "precision must be one of"),
    ("[train\nepochs = 1\n", "not valid TOML"),
])
def test_bad_config_files_are_named(tmp_path: Path, text: str, message: str):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_toml(path)
    assert str(path) in str(e.value)


def test_int_accepted_for_float_option():
    assert Config.from_dict({"optim": {"lr": 1}}).optim.lr == 1.0

"""Every integer option has a range (config.INT_RANGES), checked wherever it is set: a flag, a TOML file (a received
run dir's config.toml), or a Config changed in Python. A value that would size an allocation past any machine is a
one-line UserError naming the option, the value and the range."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from torchcls.cli import build_parser, config_from_args
from torchcls.config import INT_RANGES, Config, check_ranges, field_type, load_toml
from torchcls.errors import UserError


def test_every_integer_option_has_a_range_that_holds_its_default():
    cfg = Config()
    ints = {(s.name, f.name) for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))
            if field_type(f) is int}
    assert ints == set(INT_RANGES)
    check_ranges(cfg)


@pytest.mark.parametrize(("section", "key", "value"), [
    ("data", "batch_size", 1_000_000_000), ("data", "workers", 1_000_000), ("train", "threads", 1_000_000),
    ("governance", "sample_grid", 1_000_000_000), ("data", "img_size", 100_000), ("train", "epochs", -1),
    ("data", "batch_size", 0)])
def test_a_config_file_past_a_range_is_refused_naming_option_value_and_range(tmp_path: Path, section, key, value):
    path = tmp_path / "config.toml"
    path.write_text(f"[{section}]\n{key} = {value}\n")
    lo, hi, _ = INT_RANGES[(section, key)]
    with pytest.raises(UserError, match=rf"config.toml: \[{section}\] {key} = {value} is outside the allowed range "
                                        rf"{lo:,} to {hi:,}"):
        load_toml(path)


def test_a_huge_integer_is_named_by_its_digits(tmp_path: Path):
    (tmp_path / "c.toml").write_text(f"[data]\nbatch_size = {10**4000}\n")
    with pytest.raises(UserError, match="batch_size = a number of 4001 digits is outside"):
        load_toml(tmp_path / "c.toml")


def test_the_command_line_and_python_configs_are_checked_too():
    with pytest.raises(UserError, match=r"command line: \[data\] workers = 100000 is outside the allowed range 0 to 256"):
        config_from_args(build_parser().parse_args(["train", "--workers", "100000"]))
    cfg = Config()
    cfg.train.threads = 10**6
    with pytest.raises(UserError, match=r"\[train\] threads = 1000000 is outside the allowed range 0 to 4,096"):
        check_ranges(cfg)


def test_values_in_range_are_taken_as_before(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text("[data]\nbatch_size = 65536\nworkers = 0\nimg_size = 224\n[train]\nthreads = 4096\nseed = 12345\n"
                    "[governance]\nsample_grid = 64\n")
    cfg = load_toml(path)
    assert (cfg.data.batch_size, cfg.data.workers, cfg.data.img_size, cfg.train.threads, cfg.train.seed,
            cfg.governance.sample_grid) == (65536, 0, 224, 4096, 12345, 64)
    check_ranges(cfg)

"""Every float option has a range (config.FLOAT_RANGES; ServeConfig's `bound`s): finite always, and within the
interval that means something. TOML and argparse both read inf and nan; before, `warmup_epochs = inf` ended in
an OverflowError in the scheduler, `serve --max-body-mb nan` in a ValueError, and `serve --min-body-rate-kb nan`
passed every `<= 0` test and switched the slow-body rule and eviction off without a word."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchcls.config import FLOAT_RANGES, Config, check_ranges, field_type, load_toml, set_option
from torchcls.errors import UserError
from torchcls.serve.serve_config import ServeConfig, field_types

NON_FINITE = ("inf", "-inf", "nan")
SERVE_FLOATS = [name for name, t in field_types().items() if t is float]


def _flag(section: str, key: str) -> str:
    f = next(f for f in dataclasses.fields(getattr(Config(), section)) if f.name == key)
    return "--" + (f.metadata.get("flag") or key).replace("_", "-")


def _train(argv: list[str], tmp_path: Path, capsys) -> tuple[int, str]:
    from torchcls.cli import main

    code = main(["train", *argv, "--no-progress", "--out-dir", str(tmp_path / "runs")])
    return code, capsys.readouterr().err


def test_every_float_option_has_a_finite_range_that_holds_its_default():
    cfg = Config()
    floats = {(s.name, f.name) for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))
              if field_type(f) is float}
    assert floats == set(FLOAT_RANGES)
    for interval, _why in FLOAT_RANGES.values():
        assert all(math.isfinite(float(end)) for end in interval[1:-1].split(","))
    check_ranges(cfg)


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(("section", "key"), sorted(FLOAT_RANGES))
def test_inf_and_nan_in_any_float_option_exit_2_by_flag_and_by_file(tmp_path, capsys, section, key, value):
    """Each route a value takes: a flag, a --config file (TOML's own inf / nan), and the Python check."""
    interval, why = FLOAT_RANGES[(section, key)]
    shown = repr(float(value))
    code, err = _train([f"{_flag(section, key)}={value}"], tmp_path, capsys)  # (= : "-inf" is no option)
    assert code == 2 and "Traceback" not in err, err
    assert f"command line: [{section}] {key} = {shown} is outside the allowed range {interval} ({why})" in err, err
    (tmp_path / "c.toml").write_text(f"[{section}]\n{key} = {value}\n")
    code, err = _train(["--config", str(tmp_path / "c.toml")], tmp_path, capsys)
    assert code == 2 and f"c.toml: [{section}] {key} = {shown} is outside the allowed range {interval}" in err, err
    cfg = Config()
    setattr(getattr(cfg, section), key, float(value))
    with pytest.raises(UserError, match=rf"\[{section}\] {key} = {shown} is outside the allowed range"):
        check_ranges(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_resumed_runs_config_toml_with_inf_warmup_is_refused_not_an_overflow(tmp_path, capsys):
    """The review's case: a received run dir whose config.toml says `warmup_epochs = inf`, resumed."""
    run = tmp_path / "runs" / "got"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "config.toml").write_text("[optim]\nwarmup_epochs = inf\n")
    code, err = _train(["--config", str(run / "config.toml"), "--resume"], tmp_path, capsys)
    assert code == 2 and "Traceback" not in err and "OverflowError" not in err, err
    assert "config.toml: [optim] warmup_epochs = inf is outside the allowed range [0, 1e6] (a number of epochs" in err


@pytest.mark.parametrize(("section", "key", "value"), [
    ("data", "val_fraction", 1.0), ("data", "val_fraction", -0.1), ("optim", "lookahead_alpha", 0.0),
    ("optim", "ema", 1.0), ("optim", "momentum", 1.5), ("optim", "lr", -1e-3), ("model", "drop_path", 1.0),
    ("model", "whiten_eps", 0.0), ("optim", "warmup_epochs", 1e300), ("optim", "grad_clip", -1.0)])
def test_an_open_or_closed_end_is_where_the_interval_says(section, key, value):
    with pytest.raises(UserError, match=re.escape(f"[{section}] {key} = {value!r} is outside the allowed range")):
        set_option(Config(), section, key, value, "command line")


def test_values_at_the_closed_ends_and_whole_numbers_are_taken(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text("[data]\nval_fraction = 0\nrandom_erasing = 1.0\n[model]\nexit_threshold = 1\n"
                    "[optim]\nlookahead_alpha = 1.0\nlayer_decay = 0.0\nwarmup_epochs = 3\nlr = 0.1\n")
    cfg = load_toml(path)
    assert (cfg.data.val_fraction, cfg.data.random_erasing, cfg.model.exit_threshold, cfg.optim.lookahead_alpha,
            cfg.optim.warmup_epochs) == (0.0, 1.0, 1.0, 1.0, 3.0)
    check_ranges(cfg)


# serve: every number option is ranged, checked before anything is loaded (the artifact path is never opened).


def test_every_serve_number_option_has_a_bound_that_holds_its_default():
    from torchcls.options import check_options

    numbers = [f for f in dataclasses.fields(ServeConfig) if field_types()[f.name] in (int, float)]
    assert numbers and all(f.metadata["bound"] is not None for f in numbers), [f.name for f in numbers]
    assert {"max_body_mb", "min_body_rate_kb", "body_timeout", "header_timeout", "send_timeout"} <= set(SERVE_FLOATS)
    check_options(ServeConfig(), "serve")


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("name", SERVE_FLOATS)
def test_inf_and_nan_in_any_serve_float_option_exit_2(capsys, trained_run, name, value):
    from torchcls.cli import main

    flag = "--" + name.replace("_", "-")
    assert main(["serve", str(trained_run), f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"serve: {flag} = {float(value)!r} is outside the allowed range" in err and "Traceback" not in err, err


@pytest.mark.parametrize(("flag", "value", "interval"), [
    ("--min-body-rate-kb", "-1", "[0, 1e6]"), ("--body-timeout", "0", "(0, 86400]"),
    ("--max-header-kb", "0.5", "[1, 1024]"), ("--graceful-timeout", "-1", "[0, 86400]"),
    ("--max-wait-ms", "1e9", "[0, 60000]")])
def test_serve_floats_out_of_range_exit_2(capsys, trained_run, flag, value, interval):
    from torchcls.cli import main

    assert main(["serve", str(trained_run), f"{flag}={value}"]) == 2
    assert f"{flag} = {float(value)!r} is outside the allowed range {interval}" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "shown"), [("--port", "70000", "0 to 65,535"),
                                                      ("--probe-port", "-1", "0 to 65,535"),
                                                      ("--max-queue", "0", "1 to 1,048,576"),
                                                      ("--max-connections", "0", "1 to 1,048,576"),
                                                      ("--threads", "100000", "0 to 4,096")])
def test_serve_ints_out_of_range_exit_2(capsys, trained_run, flag, value, shown):
    from torchcls.cli import main

    assert main(["serve", str(trained_run), f"{flag}={value}"]) == 2
    assert f"serve: {flag} = {value} is outside the allowed range {shown}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-body-mb", "--min-body-rate-kb"])
def test_a_real_serve_start_with_a_nan_limit_exits_2_with_the_message(trained_run, flag):
    """The review's reproducers, as a user runs them: a traceback (--max-body-mb) and a silently disabled
    slow-body rule (--min-body-rate-kb, which used to start serving)."""
    r = subprocess.run([sys.executable, "-m", "torchcls", "serve", str(trained_run), "--port", "0", flag, "nan"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert f"serve: {flag} = nan is outside the allowed range" in r.stderr


def test_an_app_built_in_python_refuses_a_nan_rate_too():
    from torchcls.serve.app import create_app

    with pytest.raises(UserError, match=r"serve: --min-body-rate-kb = nan is outside the allowed range \[0, 1e6\]"):
        create_app(None, ServeConfig(min_body_rate_kb=math.nan))

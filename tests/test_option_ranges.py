"""Every integer option has a range (config.INT_RANGES), checked wherever it is set: a flag, a TOML file (a received
run dir's config.toml), or a Config changed in Python. A value that would size an allocation past any machine is a
one-line UserError naming the option, the value and the range."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from torchcls.cli import build_parser, config_from_args
from torchcls.config import INT_RANGES, Config, FloatRange, IntRange, check_ranges, field_type, load_toml
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


# The options of every other command (options.py, `bound=` on each number field): checked in from_args, where
# the CLI turns them into call arguments, and by the library functions called from Python.


def _commands():
    """(argv prefix, options class) of every command built from options.py."""
    from torchcls import cli, options

    yield from ((([name], cls) for name, cls, _ in cli.COMMANDS))
    yield from (([group, name], cls) for group, (_, cmds) in cli.GROUPS.items() for name, cls, _ in cmds)
    yield ["data", "shard"], options.ShardOptions


def _bounded():
    """(argv that sets one bounded option past its range, flag, what the message shows), for every one."""
    from torchcls.options import concrete_type

    for prefix, cls in _commands():
        fields = dataclasses.fields(cls)
        base = [*prefix, *(["x"] * sum(1 for f in fields if f.metadata.get("positional")))]
        base += [a for f in fields if f.metadata.get("required") for a in (f"--{f.name.replace('_', '-')}", "x")]
        for f in fields:
            bound = f.metadata.get("bound")
            if bound is None:
                assert concrete_type(cls, f) not in (int, float), f"{cls.__name__}.{f.name} has no range"
                continue
            flag = "--" + (f.metadata.get("flag") or f.name).replace("_", "-")
            if isinstance(bound, FloatRange):
                yield pytest.param([*base, f"{flag}=nan"], flag, f"nan is outside the allowed range {bound.interval}",
                                   id=f"{prefix[-1]}{flag}=nan")
            else:
                assert isinstance(bound, IntRange), f"{cls.__name__}.{f.name}: a bound is an IntRange or a FloatRange"
                for value in (bound.lo - 1, bound.hi + 1):
                    yield pytest.param([*base, f"{flag}={value}"], flag,
                                       f"{value} is outside the allowed range {bound.lo:,} to {bound.hi:,}",
                                       id=f"{prefix[-1]}{flag}={value}")


def test_every_number_option_of_every_command_has_a_range_that_holds_its_default():
    from torchcls.options import check_options

    for _, cls in _commands():
        check_options(cls(), "defaults")  # (positionals and required flags default to None: not numbers)
    assert len(list(_bounded())) > 20


@pytest.mark.parametrize(("argv", "flag", "shown"), list(_bounded()))
def test_a_number_option_of_any_command_past_its_range_exits_2_before_anything_runs(tmp_path, monkeypatch, capsys,
                                                                                      argv, flag, shown):
    from torchcls.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"command line: {flag} = {shown}" in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())  # refused before the command wrote anything


@pytest.mark.parametrize(("args", "message"), [
    (["predict", "--topk", "0"], "--topk = 0 is outside the allowed range 1 to 1,000,000"),
    (["predict", "--topk=-2"], "--topk = -2 is outside the allowed range 1 to 1,000,000"),
    (["explain", "--steps", "0"], "--steps = 0 is outside the allowed range 1 to 10,000"),
    (["explain", "--steps", str(10**7)], "--steps = 10000000 is outside the allowed range 1 to 10,000")])
def test_the_reviews_predict_and_explain_cases_exit_2_with_a_real_checkpoint(trained_run, tmp_path, capsys,
                                                                            args, message):
    """predict --topk 0 was an IndexError, -2 a torch RuntimeError; explain --steps 0 a captum AssertionError and
    10^7 one batch of 10^7 images."""
    from conftest import draw_shape
    from torchcls.cli import main

    draw_shape("circle", 32, 1).save(tmp_path / "x.png")
    command, *flags = args
    assert main([command, str(trained_run), str(tmp_path / "x.png"), *flags, "--out" if command == "explain" else
                 "--json", *([str(tmp_path / "ex")] if command == "explain" else [])]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_the_library_functions_refuse_out_of_range_values_from_python(trained_run, tmp_path):
    from conftest import draw_shape
    from torchcls.explain import explain
    from torchcls.prediction import predict

    draw_shape("square", 32, 2).save(image := tmp_path / "x.png")
    for topk, message in ((0, "--topk = 0 is outside"), (-2, "--topk = -2 is outside"),
                          (2.5, "--topk must be an integer from 1 to 1,000,000, got 2.5")):
        with pytest.raises(UserError, match=f"predict: {message}"):
            predict(trained_run, [image], topk=topk, device="cpu")
    with pytest.raises(UserError, match="explain: --steps = 0 is outside the allowed range 1 to 10,000"):
        explain(trained_run, [image], steps=0, out_dir=tmp_path / "ex")
    assert len(predict(trained_run, [image], topk=10**6, device="cpu", precision="fp32").items[0]["top"]) == 2


def test_integrated_gradients_runs_its_steps_in_bounded_batches(trained_run, tmp_path, monkeypatch):
    """steps above EXPLAIN_BATCH: captum is given internal_batch_size, so it never stacks all steps at once."""
    pytest.importorskip("captum")
    from captum.attr import IntegratedGradients

    from conftest import draw_shape
    from torchcls.explain import EXPLAIN_BATCH, explain

    seen = []
    original = IntegratedGradients.attribute
    monkeypatch.setattr(IntegratedGradients, "attribute",
                        lambda self, *a, **kw: seen.append(kw) or original(self, *a, **kw))
    draw_shape("circle", 32, 3).save(image := tmp_path / "x.png")
    (e,) = explain(trained_run, [image], steps=EXPLAIN_BATCH + 8, out_dir=tmp_path / "ex")
    assert Path(e.png).is_file()
    assert seen[0]["n_steps"] == EXPLAIN_BATCH + 8 and seen[0]["internal_batch_size"] == EXPLAIN_BATCH


def test_a_recorded_config_takes_the_default_for_a_value_outside_todays_range():
    """Ranges were declared after checkpoints had been written: a checkpoint's config with `momentum = 1.0` or
    `lookahead_alpha = 2` (lookahead off) still loads for evaluate and export, each such value named in a warning and
    replaced by the default. The two that choose the held-out images those commands score stay refused."""
    raw = {"optim": {"momentum": 1.0, "lookahead_alpha": 2.0, "lr": 0.05, "label_smoothing": 1.0},
           "data": {"batch_size": 10**9, "img_size": 48, "mixup": 10**400},
           "train": {"dist_timeout": 0}}  # an option that has since moved to [parallel]
    with pytest.warns(UserWarning) as caught:
        cfg = Config.recorded(raw, origin="ckpt metadata")
    said = [str(w.message) for w in caught]
    assert len(said) == 6, said
    assert "ckpt metadata: [optim] momentum = 1.0 is outside the allowed range [0, 1)" in said[0]
    assert all("this version's default is used instead" in s for s in said)
    assert any("[parallel] dist_timeout = 0 is outside the allowed range 1 to 604,800" in s for s in said)
    assert any("[data] mixup = a number of 401 digits is outside the allowed range [0, 1000]" in s for s in said)
    default = Config()
    assert (cfg.optim.momentum, cfg.optim.lookahead_alpha, cfg.data.batch_size, cfg.data.mixup,
            cfg.optim.label_smoothing, cfg.parallel.dist_timeout) == (
        default.optim.momentum, default.optim.lookahead_alpha, default.data.batch_size, default.data.mixup,
        default.optim.label_smoothing, default.parallel.dist_timeout)
    assert (cfg.optim.lr, cfg.data.img_size) == (0.05, 48)  # in range: taken as recorded
    with pytest.raises(UserError, match=r"\[optim\] momentum = 1.0 is outside"):  # a run's own config: refused
        Config.from_dict(raw)
    for section, key, value in (("data", "val_fraction", float("nan")), ("data", "val_fraction", 1.5),
                                ("train", "seed", 2**64)):
        with pytest.raises(UserError, match=rf"ckpt metadata: \[{section}\] {key} = .* is outside the allowed range"):
            Config.recorded({section: {key: value}}, origin="ckpt metadata")


@pytest.mark.parametrize(("section", "key"), [("train", "seed"), ("data", "val_fraction"), ("data", "source"),
                                              ("data", "augment"), ("optim", "lr"), ("train", "fp8_min_dim")])
def test_null_is_refused_where_an_option_has_no_unset_state(section, key):
    """A checkpoint's recorded config is JSON: `"seed": null` passed every check and was a RuntimeError in
    torch.manual_seed during evaluate (`val_fraction: null` a TypeError, `source: null` another)."""
    with pytest.raises(UserError, match=rf"ckpt: \[.*\] {key} must be \w+, got null; leave it out for the default"):
        Config.recorded({section: {key: None}}, origin="ckpt")


def test_null_still_means_unset_where_an_option_has_that_state():
    cfg = Config.recorded({"data": {"img_size": None, "root": None}, "train": {"channels_last": None}}, origin="x")
    assert (cfg.data.img_size, cfg.data.root, cfg.train.channels_last) == (None, None, None)


@pytest.mark.parametrize("text", ["1" + "0" * 400, "-" + "9" * 320])
def test_an_integer_too_large_for_a_float_is_a_range_error_not_an_overflow(tmp_path: Path, text: str):
    (tmp_path / "c.toml").write_text(f"[optim]\nlr = {text}\n")
    with pytest.raises(UserError, match=r"\[optim\] lr = a number of \d+ digits is outside the allowed range"):
        load_toml(tmp_path / "c.toml")


def test_evaluate_loads_a_checkpoint_recorded_before_the_ranges(trained_run, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from torchcls.checkpoint.files import META_KEY, read_meta
    from torchcls.evaluation import evaluate

    best = trained_run / "checkpoints" / "best.safetensors"
    raw = dataclasses.asdict(read_meta(best))
    raw["config"]["optim"].update(momentum=1.0, lookahead_alpha=2.0)
    save_file(load_file(best), str(old := tmp_path / "old.safetensors"), metadata={META_KEY: json.dumps(raw)})
    with pytest.warns(UserWarning, match=r"\[optim\] momentum = 1.0 is outside the allowed range"):
        then = evaluate(old, out_dir=tmp_path / "old-eval")
    now = evaluate(best, out_dir=tmp_path / "eval")
    assert then["top1"] == now["top1"] and then["n"] == now["n"] > 0


def test_bounds_copied_as_literals_equal_their_sources():
    """options.py and serve_config.py are read before the heavy modules are imported (`torchcls --help` stays light),
    so they write some limits as literals; each must stay the number it names."""
    from torchcls.artifacts.targets.base import MAX_BATCH
    from torchcls.data.preprocess import MAX_IMG_SIZE, MAX_IN_CHANS
    from torchcls.options import ExportOptions
    from torchcls.serve.serve_config import ServeConfig

    def bound(cls, name):
        return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["bound"]

    assert bound(ExportOptions, "max_batch").hi == bound(ServeConfig, "max_batch").hi == MAX_BATCH
    assert INT_RANGES[("data", "img_size")].hi == MAX_IMG_SIZE and INT_RANGES[("data", "channels")].hi == MAX_IN_CHANS

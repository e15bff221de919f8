from pathlib import Path

import pytest

from torchcls.cli import build_parser, config_from_args
from torchcls.config import Config, load_toml
from torchcls.errors import UserError
from torchcls.toml_compat import tomllib


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
    ("[precision]\nprecision = 'fp64'\n", "precision must be one of"),
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


# The [train] section as the code wrote it before [precision], [parallel] and [checkpoint] were
# split off (a literal copy of what Config.save_toml wrote then, non-default values throughout).
OLD_TRAIN_SECTION = """\
[train]
epochs = 3
seed = 7
precision = "bf16"
fp8_recipe = "rowwise"
fp8_backend = "torchao"
fp8_emulate = true
fp8_min_dim = 64
fp8_compile = false
fp8_fsdp_all_gather = false
nonfinite = "skip"
channels_last = true
compile = false
parallel = "ddp"
sync_bn = false
fsdp_param_dtype = "bf16"
fsdp_reduce_dtype = "bf16"
reshard_after_forward = false
fsdp_cpu_offload = false
fsdp_init_from_rank0 = false
async_checkpoint = true
dist_timeout = 60
device = "cpu"
threads = 2
save_every = 5
tensorboard = false
progress = false
memory_report = false
memory_snapshot = false
"""


def test_old_config_with_everything_under_train_still_loads(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text("[data]\nsource = \"mnist-5k\"\n\n" + OLD_TRAIN_SECTION + "\n[run]\nname = \"old\"\n")
    cfg = load_toml(path)
    assert (cfg.train.epochs, cfg.train.seed, cfg.train.channels_last, cfg.train.threads) == (3, 7, True, 2)
    assert (cfg.precision.precision, cfg.precision.fp8_recipe, cfg.precision.fp8_emulate) == ("bf16", "rowwise", True)
    assert (cfg.precision.fp8_min_dim, cfg.precision.fp8_compile, cfg.precision.nonfinite) == (64, False, "skip")
    assert (cfg.parallel.parallel, cfg.parallel.fsdp_param_dtype, cfg.parallel.dist_timeout) == ("ddp", "bf16", 60)
    assert (cfg.parallel.reshard_after_forward, cfg.parallel.fsdp_init_from_rank0) == (False, False)
    assert (cfg.checkpoint.save_every, cfg.checkpoint.async_checkpoint) == (5, True)

    # written back, it uses the new sections only, and reads back the same
    cfg.save_toml(tmp_path / "new.toml")
    raw = tomllib.loads((tmp_path / "new.toml").read_text())
    assert "precision" not in raw["train"] and raw["precision"]["precision"] == "bf16"
    assert raw["parallel"]["parallel"] == "ddp" and raw["checkpoint"]["save_every"] == 5
    assert load_toml(tmp_path / "new.toml") == cfg
    # the config stored inside an old checkpoint's metadata is the same dict: Config.from_dict reads it
    assert Config.from_dict(tomllib.loads(path.read_text())) == cfg


def test_moved_options_still_checked_in_their_old_section(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nparallel = 'mpi'\n")
    with pytest.raises(UserError, match=r"\[parallel\] parallel must be one of none, ddp, fsdp2"):
        load_toml(path)


def test_every_cli_flag_keeps_its_name(capsys):
    """The flags of `torchcls train` before the split, each still accepted."""
    old_train_flags = ["--epochs", "--seed", "--precision", "--fp8-recipe", "--fp8-backend", "--fp8-emulate",
                       "--fp8-min-dim", "--fp8-compile", "--fp8-fsdp-all-gather", "--nonfinite", "--channels-last",
                       "--compile", "--parallel", "--sync-bn", "--fsdp-param-dtype", "--fsdp-reduce-dtype",
                       "--reshard-after-forward", "--fsdp-cpu-offload", "--fsdp-init-from-rank0",
                       "--async-checkpoint", "--dist-timeout", "--device", "--threads", "--save-every",
                       "--tensorboard", "--progress", "--memory-report", "--memory-snapshot"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    for flag in old_train_flags:
        assert flag in help_text, flag
    args = build_parser().parse_args(["train", "--precision", "bf16", "--parallel", "ddp", "--save-every", "4",
                                      "--no-fsdp-init-from-rank0", "--epochs", "2"])
    cfg = config_from_args(args)
    assert (cfg.precision.precision, cfg.parallel.parallel, cfg.checkpoint.save_every) == ("bf16", "ddp", 4)
    assert cfg.parallel.fsdp_init_from_rank0 is False and cfg.train.epochs == 2


def test_a_recorded_config_does_not_raise_this_machines_bounds():
    """A checkpoint's recorded config (evaluate, export's parity and calibration images) keeps its options,
    except the input bounds: a received checkpoint saying max_pixels = 0 (no limit) does not lift ours."""
    raw = {"data": {"max_pixels": 0, "memory_limit_mb": 10**9, "batch_size": 7, "source": "fashion-mnist"}}
    cfg = Config.recorded(raw, origin="ckpt metadata")
    assert (cfg.data.max_pixels, cfg.data.memory_limit_mb) == (Config().data.max_pixels, Config().data.memory_limit_mb)
    assert (cfg.data.batch_size, cfg.data.source) == (7, "fashion-mnist")
    assert Config.from_dict(raw).data.max_pixels == 0  # the user's own config file may still set them


def _received_run(tmp_path: Path, name: str = "alice", names: str | None = None) -> Path:
    """runs/<name>/ as it arrives from someone else: a config.toml that raises the input bounds and sends the
    run to their tracking server, beside the files of a run dir."""
    run = tmp_path / "runs" / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "config.toml").write_text(
        f'[data]\nmax_pixels = 0\nmemory_limit_mb = 999999\nimg_size = 32\n[optim]\nlr = 0.25\n'
        f'[train]\ntracking = "mlflow"\ntracking_uri = "http://attacker.example"\n'
        f'[run]\nname = "{names or name}"\nout_dir = "{tmp_path / "runs"}"\n')
    return run / "config.toml"


def test_a_run_dirs_recorded_config_neither_raises_bounds_nor_sends_data_elsewhere(tmp_path: Path, capsys):
    default = Config()
    for config in (_received_run(tmp_path), _received_run(tmp_path, "bob", names="mine")):  # (bob names another run)
        cfg = config_from_args(build_parser().parse_args(["train", "--config", str(config), "--resume"]))
        assert (cfg.train.tracking, cfg.train.tracking_uri) == ("none", None)
        assert (cfg.data.max_pixels, cfg.data.memory_limit_mb) == (default.data.max_pixels, default.data.memory_limit_mb)
        assert cfg.optim.lr == 0.25 and cfg.data.img_size == 32 and cfg.run.resume  # how the model trains: taken
        note = " ".join(capsys.readouterr().out.split())
        assert f"{config} is taken as a run's recorded config" in note and "'http://attacker.example' not taken" in note
        assert "give --max-pixels --memory-limit-mb --tracking --tracking-uri" in note


def test_the_command_line_still_sets_them_for_ones_own_run(tmp_path: Path, capsys):
    config = _received_run(tmp_path)
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--config", str(config), "--resume", "--tracking", "mlflow", "--tracking-uri", "sqlite:///m.db",
         "--max-pixels", "0"]))
    assert (cfg.train.tracking, cfg.train.tracking_uri, cfg.data.max_pixels) == ("mlflow", "sqlite:///m.db", 0)
    assert cfg.data.memory_limit_mb == Config().data.memory_limit_mb and "memory_limit_mb = 999999" in capsys.readouterr().out
    own = tmp_path / "mine.toml"  # a config file of one's own (not in a run dir): every option taken
    own.write_text(config.read_text())
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(own)]))
    assert (cfg.train.tracking_uri, cfg.data.max_pixels, cfg.data.memory_limit_mb) == ("http://attacker.example", 0,
                                                                                      999999)
    assert "recorded config" not in capsys.readouterr().out


def test_a_run_dirs_recorded_config_names_no_audit_log_or_key_file(tmp_path: Path, capsys):
    """A received run dir's config.toml may not choose the file a resumed run appends its audit record to, nor
    the key files that sign it: those come from the command line (or the defaults beside the runs)."""
    config = _received_run(tmp_path)
    config.write_text(config.read_text() + f'[governance]\naudit_log = "{tmp_path / "elsewhere.jsonl"}"\n'
                      f'signing_key_file = "{tmp_path / "key.pem"}"\naudit_key_file = "{tmp_path / "k"}"\n')
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(config), "--resume"]))
    assert (cfg.governance.audit_log, cfg.governance.signing_key_file, cfg.governance.audit_key_file) == (None,) * 3
    assert "give --max-pixels --memory-limit-mb --audit-key-file --audit-log --signing-key-file" in \
        " ".join(capsys.readouterr().out.split())
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(config), "--resume", "--audit-log",
                                                      str(tmp_path / "mine.jsonl")]))
    assert cfg.governance.audit_log == str(tmp_path / "mine.jsonl") and cfg.governance.signing_key_file is None


def test_a_run_dirs_recorded_config_continues_the_run_dir_it_is_in(tmp_path: Path, capsys):
    """bob's config.toml names the run dir `prod` of elsewhere: --resume continues bob (whose audit log, beside
    it, takes the record), not prod; --out-dir / --name still choose."""
    config = _received_run(tmp_path, "bob", names="prod")
    config.write_text(config.read_text().replace(str(tmp_path / "runs"), str(tmp_path / "home" / "runs")))
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(config), "--resume"]))
    assert (cfg.run.out_dir, cfg.run.name) == (str(tmp_path / "runs"), "bob")
    assert f"names the run dir {tmp_path / 'home' / 'runs' / 'prod'}; continuing the one it is in" in \
        " ".join(capsys.readouterr().out.split())
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(config), "--resume", "--name", "x"]))
    assert (cfg.run.out_dir, cfg.run.name) == (str(tmp_path / "runs"), "x")


@pytest.mark.parametrize("name", ["config.toml", "settings.toml"])
def test_any_config_given_to_resume_is_taken_as_a_recorded_one(tmp_path: Path, name: str, capsys):
    """A config with no run dir's files beside it (or renamed) given with --resume: what it may not set (tracking,
    bounds, audit files) stays as the command line says; the run it names is the one continued (one's own
    experiments/r18.toml names its run)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / name).write_text(f'[run]\nout_dir = "{tmp_path / "runs"}"\nname = "prod"\n'
                               '[train]\ntracking = "mlflow"\ntracking_uri = "http://attacker.example"\n')
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(shared / name), "--resume"]))
    assert (cfg.run.out_dir, cfg.run.name) == (str(tmp_path / "runs"), "prod")
    assert (cfg.train.tracking, cfg.train.tracking_uri) == ("none", None)
    assert "'http://attacker.example' not taken" in " ".join(capsys.readouterr().out.split())
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(shared / name)]))  # a new run: as given
    assert (cfg.run.name, cfg.train.tracking_uri) == ("prod", "http://attacker.example")


def test_the_resume_hint_gives_on_the_command_line_what_config_toml_does_not_set(tmp_path: Path):
    from torchcls.config import resume_command

    cfg = Config()
    cfg.train.tracking, cfg.train.tracking_uri = "mlflow", "sqlite:///m.db"
    assert resume_command(tmp_path / "r", cfg) == (f"torchcls train --config {tmp_path / 'r' / 'config.toml'} --resume "
                                                   "--tracking mlflow --tracking-uri sqlite:///m.db")
    assert resume_command(tmp_path / "r", Config()).endswith("--resume")

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config
from torchcls.checkpoint.files import load_model, read_meta
from torchcls.errors import UserError
from torchcls.toml_compat import tomllib
from torchcls.training import train


def test_run_dir_contents(trained_run):
    for name in ("config.toml", "metrics.jsonl", "checkpoints/best.safetensors", "checkpoints/last.safetensors",
                 "checkpoints/last.state.safetensors", "curves.png", "report.html"):
        assert (trained_run / name).is_file(), name
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == list(range(1, 9)) and all("val_top1" in e for e in epochs)
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    cfg = tomllib.loads((trained_run / "config.toml").read_text())
    assert cfg["train"]["epochs"] == 8 and cfg["run"]["name"] == "shapes"
    meta = read_meta(trained_run / "checkpoints" / "best.safetensors")
    assert meta.classes == ["circle", "square"] and meta.preprocess.channels == 3


def test_training_learns_the_shapes(trained_run):
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("val_top1", 0) for r in records) >= 0.85


def test_resume_gives_identical_weights(tmp_path, shapes_dir):
    """Interrupt mid-epoch (Ctrl-C), resume: the final weights equal an uninterrupted run's."""
    full = train(tiny_config(shapes_dir, tmp_path, "full", epochs=3))

    def interrupt(step):
        if step == 6:  # mid-epoch 2 (4 steps per epoch)
            raise KeyboardInterrupt

    cfg = tiny_config(shapes_dir, tmp_path, "cut", epochs=3)
    cut = train(cfg, callbacks=[interrupt])
    assert cut.interrupted and cut.steps == 6
    cfg.run.resume = True
    resumed = train(cfg)
    assert not resumed.interrupted and resumed.steps == full.steps == 12
    a = load_file(full.last_checkpoint)
    b = load_file(resumed.last_checkpoint)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps_logged = [json.loads(line)["step"] for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == sorted(steps_logged)  # the log reads like one run


def test_existing_run_needs_resume_and_resume_needs_a_run(tmp_path, shapes_dir):
    train(tiny_config(shapes_dir, tmp_path, "x", epochs=1))
    with pytest.raises(UserError, match="already exists"):
        train(tiny_config(shapes_dir, tmp_path, "x", epochs=1))
    cfg = tiny_config(shapes_dir, tmp_path, "never", epochs=1)
    cfg.run.resume = True
    with pytest.raises(UserError, match="no checkpoints/last.state.safetensors"):
        train(cfg)


def test_bf16_channels_last_and_sgd_train(tmp_path, shapes_dir):
    cfg = tiny_config(shapes_dir, tmp_path, "bf16", epochs=1)
    cfg.precision.precision, cfg.train.channels_last, cfg.optim.optimizer = "bf16", True, "sgd"
    result = train(cfg)
    model, _ = load_model(result.last_checkpoint)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights


def test_tensorboard_logs(tmp_path, shapes_dir):
    pytest.importorskip("tensorboard")
    cfg = tiny_config(shapes_dir, tmp_path, "tb", epochs=1)
    cfg.train.tensorboard = True
    result = train(cfg)
    assert list((result.run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoint_of_other_model_is_refused(tmp_path, trained_run):
    from safetensors.torch import save_file

    from torchcls.checkpoint.files import load_weights_into
    from torchcls.models import SmallNet

    bad = tmp_path / "other.safetensors"
    save_file({"fc.weight": torch.zeros(2, 2)}, bad)
    with pytest.raises(UserError, match="does not fit the model"):
        load_weights_into(SmallNet(2, 3), bad)
    with pytest.raises(UserError, match="no torchcls metadata"):
        load_model(bad)
    pickle = tmp_path / "evil.safetensors"
    pickle.write_bytes(b"\x80\x04\x95 not safetensors")
    with pytest.raises(UserError, match="not a safetensors checkpoint"):
        load_model(pickle)


def test_log_every_sets_the_step_records(tmp_path, shapes_dir):
    cfg = tiny_config(shapes_dir, tmp_path, "logs", epochs=1)
    cfg.train.log_every = 2
    result = train(cfg)
    steps = [json.loads(line)["step"] for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "step"]
    assert steps == list(range(2, result.steps + 1, 2))
    cfg = tiny_config(shapes_dir, tmp_path, "bad", epochs=1)
    cfg.train.log_every = -1
    with pytest.raises(UserError, match="--log-every"):
        train(cfg)

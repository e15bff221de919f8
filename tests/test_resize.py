"""Progressive resizing (--resize-schedule): the schedule, the batch resize, and a real run that follows it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_image_folder, tiny_config
from torchcls.errors import UserError
from torchcls.training.resize import parse_schedule, resize_batch, size_at


def test_schedule_gives_each_epoch_its_size_then_the_full_size() -> None:
    stages = parse_schedule("16:2, 20:1")
    assert stages == [(16, 2), (20, 1)]
    assert [size_at(stages, e) for e in range(5)] == [16, 16, 20, None, None]
    assert parse_schedule("") == [] and size_at([], 0) is None


@pytest.mark.parametrize("spec", ["16", "16:0", "x:2", "2:3", "16:2,20"])
def test_malformed_schedule_is_refused_with_the_form_to_use(spec: str) -> None:
    with pytest.raises(UserError, match="SIZE:EPOCHS"):
        parse_schedule(spec)


def test_resize_batch_keeps_the_memory_format() -> None:
    x = torch.rand(3, 2, 28, 28)
    nchw, nhwc = resize_batch(x, 16), resize_batch(x.contiguous(memory_format=torch.channels_last), 16)
    assert nchw.shape == nhwc.shape == (3, 2, 16, 16)
    assert nchw.is_contiguous() and nhwc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(nchw, nhwc)
    assert resize_batch(x, 28) is x
    flat = torch.full((1, 1, 28, 28), 0.5)  # antialiased bilinear keeps a flat image flat
    torch.testing.assert_close(resize_batch(flat, 12), torch.full((1, 1, 12, 12), 0.5))


def test_training_follows_the_schedule_and_validates_at_full_size(tmp_path: Path, monkeypatch) -> None:
    from torchcls.training import train, trainer
    from torchcls.training.rundir import read_metrics

    seen: list[tuple[int, ...]] = []

    def spy(x: torch.Tensor, size: int) -> torch.Tensor:
        out = resize_batch(x, size)
        seen.append(tuple(out.shape[-3:]))
        return out

    monkeypatch.setattr(trainer, "resize_batch", spy)
    cfg = tiny_config(make_image_folder(tmp_path / "shapes", per_class=8), tmp_path / "runs", epochs=3)
    cfg.data.resize_schedule, cfg.data.val_fraction, cfg.data.in_memory = "16:1,24:1", 0.25, "on"
    result = train(cfg)
    epochs = [r for r in read_metrics(result.run_dir) if r["kind"] == "epoch"]
    assert [r.get("train_img_size") for r in epochs] == [16, 24, None]
    assert all("val_top1" in r for r in epochs)  # validated at 32 px after the smaller epochs too
    steps = len(seen) // 2
    assert seen == [(3, 16, 16)] * steps + [(3, 24, 24)] * steps  # the third epoch trains at --img-size
    assert steps == epochs[0]["step"]


def test_cli_refuses_a_bad_schedule_before_making_a_run_dir(tmp_path: Path) -> None:
    from torchcls.training import train

    cfg = tiny_config(tmp_path / "no-data", tmp_path / "runs")
    cfg.data.resize_schedule = "16"
    with pytest.raises(UserError, match="--resize-schedule '16'"):
        train(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_schedule_that_never_reaches_the_full_size_or_upsamples_is_refused() -> None:
    from torchcls.training.resize import check_schedule

    check_schedule("16:2,20:1", 4, 28)
    check_schedule("", 1, None)
    with pytest.raises(UserError, match="covers 3 epoch.*--epochs 3"):
        check_schedule("16:2,20:1", 3, 28)
    with pytest.raises(UserError, match="32 px is not smaller than --img-size 28"):
        check_schedule("32:1", 4, 28)


@pytest.mark.parametrize(("spec", "reason"), [
    ("40000:1", "SIZE 40,000 px \\(in '40000:1'\\) is outside the allowed range 4 to 2,048 px"),
    ("16:1,2049:1", "SIZE 2,049 px \\(in '2049:1'\\) is outside the allowed range 4 to 2,048 px"),
    ("9" * 40 + ":1", "SIZE of 40 digits px"),
    ("16:1000001", "its EPOCHS add up to 1,000,001 or more, outside the allowed range 1 to 1,000,000"),
    ("16:600000,20:600000", "its EPOCHS add up to 1,200,000 or more, outside the allowed range 1 to 1,000,000"),
])
def test_schedule_sizes_and_epochs_are_bounded_when_parsed(spec: str, reason: str) -> None:
    """Second review: '40000:1' passed (SIZE >= 4 only, and --img-size, None by default, was compared with nothing):
    the first epoch resized each batch to 40000 px, 763 GiB."""
    from torchcls.training.resize import check_schedule

    with pytest.raises(UserError, match=f"--resize-schedule '{spec[:20]}.*{reason}"):
        parse_schedule(spec)
    with pytest.raises(UserError, match=reason):
        check_schedule(spec, 2_000_000, None)  # (with no --img-size to compare with)


def test_schedule_sizes_up_to_the_largest_model_input_still_parse() -> None:
    assert parse_schedule("4:1,2048:999998") == [(4, 1), (2048, 999_998)]
    assert size_at(parse_schedule("2048:1"), 0) == 2048

"""Augmentation presets from torchvision v2, random erasing, drop-path, mixup/cutmix and flip TTA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from conftest import draw_shape, make_image_folder
from torchcls.config import Config, DataConfig, set_option
from torchcls.data import Preprocess, build_transform
from torchcls.data.mixing import Mixing, build_mixing
from torchcls.data.transforms import AUGMENTS, POLICIES, batch_augmentable
from torchcls.errors import UserError
from torchcls.evaluation.tta import tta_logits, tta_probs
from torchcls.models.registry import ModelSpec, create_model

SIZE = 32


def _image(channels: int) -> torch.Tensor:
    """A real picture (a shape on a background), uint8 CxHxW: crops, flips and colour ops all change it."""
    img = torch.from_numpy(np.array(draw_shape("square", SIZE, seed=3))).permute(2, 0, 1).contiguous()
    return img[:1] if channels == 1 else img


def _pre(channels: int) -> Preprocess:
    return Preprocess(SIZE, channels, (0.5,) * channels, (0.25,) * channels)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("augment", AUGMENTS)
def test_each_preset_runs_on_grey_and_rgb_and_changes_the_image(augment, channels):
    img, pre = _image(channels), _pre(channels)
    plain = build_transform(pre, train=False, source_size=SIZE)(img)
    train = build_transform(pre, train=True, augment=augment, source_size=SIZE)
    torch.manual_seed(0)
    outs = [train(img) for _ in range(8)]
    for out in outs:
        assert out.shape == (channels, SIZE, SIZE) and out.dtype == torch.float32
    changed = sum(not torch.equal(out, plain) for out in outs)
    if augment == "none":
        assert changed == 0
    else:  # a policy may draw its identity op now and then, never eight times in a row
        assert changed >= 4, f"{augment} left {8 - changed} of 8 images unchanged"
    assert torch.equal(build_transform(pre, train=False, augment=augment, source_size=SIZE)(img), plain)


def test_max_shift_zero_leaves_the_flip_preset_mirrors_only():
    img, pre = _image(1), _pre(1)
    plain = build_transform(pre, train=False, source_size=SIZE)(img)
    assert torch.equal(build_transform(pre, True, "light", SIZE, max_shift=0)(img), plain)
    flip = build_transform(pre, True, "flip", SIZE, max_shift=0)
    outs = [flip(img) for _ in range(16)]
    assert all(torch.equal(o, plain) or torch.equal(o, plain.flip(-1)) for o in outs)
    assert any(torch.equal(o, plain.flip(-1)) for o in outs)


def test_the_policies_are_torchvisions():
    from torchvision.transforms import v2

    pre = _pre(3)
    for name, kind in (("randaugment", v2.RandAugment), ("trivialaugment", v2.TrivialAugmentWide),
                       ("autoaugment", v2.AutoAugment)):
        steps = build_transform(pre, train=True, augment=name).transforms
        assert any(isinstance(s, kind) for s in steps) and name in POLICIES


def test_random_erasing_erases_after_normalisation():
    pre = Preprocess(SIZE, 3, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    white = torch.full((3, SIZE, SIZE), 255, dtype=torch.uint8)  # normalises to 1.0 everywhere
    torch.manual_seed(0)
    erased = build_transform(pre, train=True, augment="none", source_size=SIZE, random_erasing=1.0)(white)
    zeros = (erased == 0).all(dim=0)
    assert 0 < zeros.sum() < SIZE * SIZE  # a box took the mean colour (0 after Normalize)
    assert torch.equal(erased[:, ~zeros], torch.ones_like(erased[:, ~zeros]))  # the rest is untouched
    never = build_transform(pre, train=True, augment="none", source_size=SIZE, random_erasing=0.0)(white)
    assert torch.equal(never, torch.ones_like(never))
    evaluation = build_transform(pre, train=False, source_size=SIZE, random_erasing=1.0)(white)
    assert torch.equal(evaluation, torch.ones_like(evaluation))  # training only
    assert not batch_augmentable("flip", 0.25) and not batch_augmentable("randaugment")
    assert batch_augmentable("standard")


def test_bad_augmentation_values_are_clear_errors():
    pre = _pre(3)
    with pytest.raises(UserError, match="--augment must be one of .*randaugment.*got 'heavy'"):
        build_transform(pre, train=True, augment="heavy")
    with pytest.raises(UserError, match=r"--random-erasing must be a probability in \[0, 1\], got -0.1"):
        build_transform(pre, train=True, random_erasing=-0.1)
    with pytest.raises(UserError, match="augment must be one of"):
        set_option(Config(), "data", "augment", "randaug", "command line")
    set_option(cfg := Config(), "data", "augment", "trivialaugment", "command line")
    assert cfg.data.augment == "trivialaugment"
    with pytest.raises(UserError, match=rf"--max-shift must be between 0 and {SIZE - 1} pixels .* got {SIZE}"):
        build_transform(pre, train=True, augment="light", max_shift=SIZE)
    for flag in ("mixup", "cutmix"):
        with pytest.raises(UserError, match=f"--{flag} is the alpha .* must be >= 0 .*got -0.5"):
            build_mixing(DataConfig(**{flag: -0.5}), 0.1, num_classes=10, batch_size=8)


def test_drop_path_reaches_timm_models_and_is_refused_elsewhere():
    from timm.layers import DropPath

    model = create_model(ModelSpec("resnet18", 3, 1, SIZE, drop_path_rate=0.1))
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    assert rates and max(rates) == pytest.approx(0.1)
    plain = create_model(ModelSpec("resnet18", 3, 1, SIZE))
    assert not any(isinstance(m, DropPath) for m in plain.modules())
    with pytest.raises(UserError, match="--drop-path applies to timm models .* not to 'smallnet'"):
        create_model(ModelSpec("smallnet", 3, 1, 28, drop_path_rate=0.1))
    with pytest.raises(UserError, match="not to 'tv/resnet18'"):
        create_model(ModelSpec("tv/resnet18", 3, 3, SIZE, drop_path_rate=0.1))
    with pytest.raises(UserError, match=r"drop_path_rate \(--drop-path\) must be a number in \[0.0, 1.0\], got 1.5"):
        create_model(ModelSpec("resnet18", 3, 3, SIZE, drop_path_rate=1.5))


def test_mixing_gives_soft_targets_that_sum_to_one_and_the_loss_trains():
    cfg = DataConfig(mixup=0.8, cutmix=1.0)
    mixing = build_mixing(cfg, label_smoothing=0.1, num_classes=5, batch_size=8, seed=0)
    assert build_mixing(DataConfig(), 0.1, 5, 8) is None  # both off: the plain loss stays
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    x, y = torch.randn(8, 3, 8, 8), torch.arange(8) % 5
    before = x.clone()
    numpy_state = np.random.get_state()[1].copy()
    mixed, soft = mixing(x.clone(), y, step=3)
    assert soft.shape == (8, 5) and torch.allclose(soft.sum(dim=1), torch.ones(8))
    assert (soft > 0).all() and not torch.equal(mixed, before)  # smoothing: no exact zeros; images mixed
    assert np.array_equal(np.random.get_state()[1], numpy_state)  # numpy's global generator untouched
    again, soft2 = mixing(before.clone(), y, step=3)  # the same step mixes the same way (exact resume)
    assert torch.equal(again, mixed) and torch.equal(soft2, soft)
    loss = mixing.loss(model(mixed), soft)
    loss.backward()
    assert loss.item() > 0 and model[1].weight.grad.abs().sum() > 0
    odd_x, odd_soft = mixing(torch.randn(7, 3, 8, 8), y[:7])  # the short last batch of an epoch
    assert odd_x.shape == (7, 3, 8, 8) and torch.allclose(odd_soft.sum(dim=1), torch.ones(7))
    assert odd_soft[-1].argmax() == y[6] and odd_soft[-1].max() == pytest.approx(0.9 + 0.1 / 5)
    assert mixing.state_dict() == {"calls": 3}


def test_mixing_refuses_an_odd_batch_and_mixes_multilabel_targets():
    with pytest.raises(UserError, match="--mixup 0.2 pairs each image .* must be even, got 7; use --batch-size 8"):
        build_mixing(DataConfig(mixup=0.2), 0.0, num_classes=4, batch_size=7)
    mixing = Mixing(4, mixup=1.0, seed=1, multilabel=True)
    targets = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0]] * 2, dtype=torch.float32)
    _, soft = mixing(torch.randn(4, 1, 4, 4), targets, step=0)
    assert soft.shape == (4, 4) and ((soft >= 0) & (soft <= 1)).all()
    assert isinstance(mixing.loss, nn.BCEWithLogitsLoss)


class _LeftHalf(nn.Module):
    """A model that sees only the left half of the image: flipping changes its answer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = x[..., : x.shape[-1] // 2].mean(dim=(2, 3))
        return torch.cat([left, -left], dim=1) * 5


def test_tta_flip_averages_the_image_and_its_mirror():
    model = _LeftHalf()
    x = torch.randn(4, 1, 6, 6)
    expected = (model(x).softmax(1) + model(x.flip(-1)).softmax(1)) / 2
    assert torch.allclose(tta_probs(model, x, "flip"), expected)
    assert not torch.allclose(expected, model(x).softmax(1))
    assert torch.allclose(tta_logits(model, x, "flip").softmax(1), expected, atol=1e-6)
    assert torch.equal(tta_logits(model, x, "none"), model(x))
    symmetric = x + x.flip(-1)  # a flip-symmetric input: TTA changes nothing
    assert torch.allclose(tta_probs(model, symmetric, "flip"), model(symmetric).softmax(1))
    with pytest.raises(UserError, match="--tta must be one of none, flip, multicrop, got 'crop'"):
        tta_probs(model, x, "crop")


@pytest.fixture(scope="module")
def untrained_run(tmp_path_factory):
    """A run dir holding a real (untrained) SmallNet checkpoint over a small shapes folder."""
    from torchcls.checkpoint.files import CheckpointMeta, save_weights

    base = tmp_path_factory.mktemp("tta")
    data = make_image_folder(base / "shapes", per_class=8)
    cfg = Config()
    cfg.data.source, cfg.data.img_size, cfg.data.val_fraction = str(data), SIZE, 0.25
    run = base / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.manual_seed(0)
    model = create_model(ModelSpec("smallnet", 2, 3, SIZE))
    meta = CheckpointMeta(ModelSpec("smallnet", 2, 3, SIZE), ["circle", "square"], _pre(3), cfg.to_dict(), 0, 0)
    save_weights(run / "checkpoints" / "best.safetensors", model, meta)
    return run / "checkpoints" / "best.safetensors", base


def test_evaluate_records_tta_and_predict_applies_it(untrained_run):
    from PIL import Image

    from torchcls.evaluation import evaluate
    from torchcls.prediction import predict

    ckpt, base = untrained_run
    plain = evaluate(ckpt, workers=0, out_dir=base / "plain")
    flip = evaluate(ckpt, workers=0, out_dir=base / "flip", tta="flip")
    assert json.loads((base / "flip" / "eval.json").read_text())["tta"] == "flip"
    assert json.loads((base / "plain" / "eval.json").read_text())["tta"] == "none"
    assert plain["n"] == flip["n"] == 4 and plain["loss"] != flip["loss"]
    with pytest.raises(UserError, match="--tta must be one of"):
        evaluate(ckpt, workers=0, out_dir=base / "bad", tta="five-crop")

    pic = np.asarray(draw_shape("circle", SIZE, seed=9))
    Image.fromarray(np.concatenate([pic[:, : SIZE // 2], pic[:, : SIZE // 2][:, ::-1]], axis=1)).save(
        base / "symmetric.png")
    Image.fromarray(pic).save(base / "plain.png")
    pair = [base / "symmetric.png", base / "plain.png"]  # fp32: bf16 (auto) rounds differently per batch shape
    none = {p["file"]: p["top"] for p in predict(ckpt, pair, precision="fp32").items}
    tta = {p["file"]: p["top"] for p in predict(ckpt, pair, tta="flip", precision="fp32").items}
    sym = str(base / "symmetric.png")
    assert [t["prob"] for t in tta[sym]] == pytest.approx([t["prob"] for t in none[sym]], abs=1e-5)
    assert tta[str(base / "plain.png")] != none[str(base / "plain.png")]


def test_training_runs_with_a_policy_and_random_erasing(tmp_path):
    from conftest import tiny_config
    from torchcls.training import train

    cfg = tiny_config(make_image_folder(tmp_path / "shapes", per_class=6), tmp_path / "runs", epochs=1)
    cfg.data.augment, cfg.data.random_erasing = "trivialaugment", 0.5
    result = train(cfg)
    saved = (result.run_dir / "config.toml").read_text()
    assert 'augment = "trivialaugment"' in saved and "random_erasing = 0.5" in saved


def test_the_in_memory_loader_leaves_library_transforms_to_the_per_sample_path(tmp_path):
    from torchcls.data import build_data
    from torchcls.data.inmemory import bundle_loaders

    cfg = DataConfig(source=str(make_image_folder(tmp_path / "shapes", per_class=4)), img_size=SIZE,
                     augment="randaugment", batch_size=4)
    bundle = build_data(cfg, seed=0)
    assert bundle_loaders(bundle, cfg, seed=0) is None  # auto: the map-style loader runs RandAugment
    cfg.augment, cfg.random_erasing = "flip", 0.25
    assert bundle_loaders(bundle, cfg, seed=0) is None
    cfg.in_memory = "on"
    with pytest.raises(UserError, match="--augment flip --random-erasing 0.25 runs per sample: use --in-memory auto"):
        bundle_loaders(bundle, cfg, seed=0)
    cfg.random_erasing = 0.0
    assert bundle_loaders(bundle, cfg, seed=0) is not None


def test_the_flags_parse():
    from torchcls.cli import build_parser
    from torchcls.options import config_from_args

    parser = build_parser()
    args = parser.parse_args(["train", "--augment", "autoaugment", "--random-erasing", "0.25", "--mixup", "0.8",
                              "--cutmix", "1.0", "--drop-path", "0.1"])
    cfg = config_from_args(args)
    assert (cfg.data.augment, cfg.data.random_erasing, cfg.data.mixup, cfg.data.cutmix, cfg.model.drop_path) == (
        "autoaugment", 0.25, 0.8, 1.0, 0.1)
    assert parser.parse_args(["evaluate", "run", "--tta", "flip"]).tta == "flip"
    assert parser.parse_args(["predict", "run", "x.png", "--tta", "flip"]).tta == "flip"


@pytest.mark.slow  # an ONNX export (~20 s)
def test_tta_flip_on_an_exported_artifact_matches_the_eager_model(untrained_run):
    from PIL import Image

    from torchcls.artifacts import export
    from torchcls.prediction import predict

    ckpt, base = untrained_run
    artifact = export(ckpt, target="onnx", out=base / "onnx" / "model.onnx", parity_images=4).path
    Image.fromarray(np.asarray(draw_shape("square", SIZE, seed=11))).save(base / "pic.png")
    for tta in ("none", "flip"):
        eager, exported = (predict(m, [base / "pic.png"], tta=tta, precision="fp32").items[0]["top"]
                           for m in (ckpt, artifact))  # the ONNX artifact is fp32: so is the eager reference
        assert [t["label"] for t in exported] == [t["label"] for t in eager]
        assert [t["prob"] for t in exported] == pytest.approx([t["prob"] for t in eager], abs=1e-5)
    flipped = predict(artifact, [base / "pic.png"], tta="flip").items[0]["top"]
    assert flipped != predict(artifact, [base / "pic.png"]).items[0]["top"]

"""The fast-training options (issue 31): each does what its help says, off changes nothing, and a run using
all of them resumes bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from conftest import make_image_folder, tiny_config
from torchcls.cli import build_parser, config_from_args
from torchcls.config import Config, OptimConfig, load_toml
from torchcls.data.inmemory import InMemoryLoader
from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError
from torchcls.evaluation.tta import tta_probs, views
from torchcls.models.fastnet import FastNet
from torchcls.training.init import FirstBiasFreeze, apply_dirac, apply_whitening, first_bias, parse_init
from torchcls.training.optim import build_optimizer, param_groups
from torchcls.training.selective import SelectiveBackprop


def _correlated_images(n: int = 64, c: int = 1, size: int = 12, seed: int = 0) -> torch.Tensor:
    """Smoothed noise: neighbouring pixels correlated, so whitening has work to do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, size + 2, size + 2, generator=g)
    return F.avg_pool2d(x, 3, stride=1) + 0.3  # a mean too: the second moments are not centred


# -- --init whiten ------------------------------------------------------------------------------------
def _output_moments(conv: nn.Conv2d, images: torch.Tensor, channels: int) -> torch.Tensor:
    out = F.conv2d(images.double(), conv.weight.double()[:channels])  # every patch at stride 1, as whitened
    flat = out.permute(0, 2, 3, 1).reshape(-1, channels)
    return flat.T @ flat / len(flat)


@pytest.mark.parametrize("c,k,out", [(1, 3, 24), (3, 2, 24), (3, 3, 24)])
def test_whitened_first_conv_has_identity_second_moments_on_the_sample(c: int, k: int, out: int) -> None:
    images = _correlated_images(c=c)
    conv = nn.Conv2d(c, out, k, bias=False)
    before = conv.weight.detach().clone()
    n = apply_whitening(conv, images, eps=1e-9)
    d = c * k * k
    assert n == min(d, out // 2)
    moments = _output_moments(conv, images, n)
    torch.testing.assert_close(moments, torch.eye(n, dtype=torch.float64), atol=2e-4, rtol=0)
    w = conv.weight.detach()
    assert torch.equal(w[n:2 * n], -w[:n])  # each filter and its negative
    assert torch.equal(w[2 * n:], before[2 * n:])  # more out-channels than 2 x c x k x k: the rest keep their init


def test_with_fewer_out_channels_the_top_eigenvectors_are_taken() -> None:
    images = _correlated_images()
    conv = nn.Conv2d(1, 6, 3, bias=False)  # 3 of the 9 directions
    eps = 5e-4
    assert apply_whitening(conv, images, eps) == 3
    patches = images.double().unfold(2, 3, 1).unfold(3, 3, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 9)
    values, vectors = torch.linalg.eigh(patches.T @ patches / len(patches))
    top = vectors[:, -3:].flip(1).T / (values[-3:].flip(0) + eps).sqrt()[:, None]  # largest first
    got = conv.weight.detach().double()[:3].reshape(3, 9)
    torch.testing.assert_close(got.abs(), top.abs(), atol=1e-5, rtol=1e-4)  # (an eigenvector's sign is free)
    moments = _output_moments(conv, images, 3)  # the whitened directions: diag(l / (l + eps))
    torch.testing.assert_close(moments, torch.diag(values[-3:].flip(0) / (values[-3:].flip(0) + eps)),
                               atol=1e-5, rtol=1e-4)


def test_whitening_refuses_what_it_cannot_whiten() -> None:
    with pytest.raises(UserError, match="at least 2"):
        apply_whitening(nn.Conv2d(1, 1, 3), _correlated_images(), 5e-4)
    with pytest.raises(UserError, match="must read the image"):
        apply_whitening(nn.Conv2d(3, 24, 3), _correlated_images(c=1), 5e-4)
    with pytest.raises(UserError, match="whiten-eps"):
        apply_whitening(nn.Conv2d(1, 24, 3), _correlated_images(), 0.0)
    with pytest.raises(UserError, match="unknown 'whitten'"):
        parse_init("whitten,dirac")
    assert parse_init(" whiten , dirac ") == ("whiten", "dirac") and parse_init("") == ()


# -- --init dirac -------------------------------------------------------------------------------------
def test_dirac_init_makes_stride1_convs_the_identity_on_their_covered_channels() -> None:
    torch.manual_seed(0)
    net = FastNet(10, 1)
    stem, strided = net.stem[0].weight.detach().clone(), net.stages[0][0][0].weight.detach().clone()
    assert len(apply_dirac(net)) == 4  # the two residual blocks' two convolutions
    x = torch.randn(2, 48, 14, 14)
    for conv in (net.stages[0][1].body[0][0], net.stages[0][1].body[1][0]):
        torch.testing.assert_close(conv(x), x, rtol=0, atol=0)
    assert torch.equal(net.stem[0].weight, stem) and torch.equal(net.stages[0][0][0].weight, strided)

    wide = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3, padding=1, bias=False))
    rest = wide[1].weight.detach()[4:].clone()
    apply_dirac(wide)
    y = torch.randn(2, 4, 6, 6)
    out = wide[1](y)
    assert torch.equal(out[:, :4], y) and torch.equal(wide[1].weight[4:], rest)  # the widening filters keep theirs


# -- --bn-bias-lr-scale -------------------------------------------------------------------------------
def test_batchnorm_biases_get_a_group_at_lr_times_the_scale_without_decay() -> None:
    net = FastNet(10, 1)
    bn_biases = {id(m.bias) for m in net.modules() if isinstance(m, nn.BatchNorm2d)}
    cfg = OptimConfig(optimizer="sgd", lr=0.1, weight_decay=5e-4, bn_bias_lr_scale=64.0)
    groups = param_groups(net, cfg)
    scaled = [g for g in groups if g["lr_scale"] == 64.0]
    assert len(scaled) == 1 and {id(p) for p in scaled[0]["params"]} == bn_biases
    assert scaled[0]["lr"] == pytest.approx(6.4) and scaled[0]["weight_decay"] == 0.0
    assert all(id(p) not in bn_biases for g in groups if g is not scaled[0] for p in g["params"])
    assert groups[0]["lr_scale"] == 1.0  # group 0 (the logged rate) is --lr's
    assert all(g["lr_scale"] == 1.0 for g in param_groups(net, OptimConfig(optimizer="sgd")))  # default: off
    with pytest.raises(UserError, match="bn-bias-lr-scale"):
        param_groups(net, OptimConfig(bn_bias_lr_scale=0.0))


# -- --lookahead --------------------------------------------------------------------------------------
def _lookahead_run(cfg: OptimConfig, steps: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = build_optimizer(model, cfg)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_lookahead_pulls_the_weights_back_alpha_of_the_way_every_k_steps() -> None:
    plain = OptimConfig(optimizer="sgd", lr=0.5, momentum=0.9, weight_decay=0.0)
    ahead = OptimConfig(optimizer="sgd", lr=0.5, momentum=0.9, weight_decay=0.0, lookahead=2, lookahead_alpha=0.5)
    # timm's wrapper takes its slow weights from the fast ones at the first sync (step 2): no change there ...
    torch.testing.assert_close(_lookahead_run(ahead, 2), _lookahead_run(plain, 2), rtol=0, atol=0)
    # ... and at step 4 they move half of the way from there to where plain SGD has gone since
    slow, fast = _lookahead_run(plain, 2), _lookahead_run(plain, 4)
    torch.testing.assert_close(_lookahead_run(ahead, 4), slow + 0.5 * (fast - slow))
    with pytest.raises(UserError, match="lookahead"):
        param_groups(nn.Linear(2, 2), OptimConfig(lookahead=3, lookahead_alpha=0.0))


# -- --freeze-first-bias-after-epochs -----------------------------------------------------------------
def test_the_first_layers_bias_is_the_convs_or_the_batchnorm_after_it() -> None:
    assert first_bias(FastNet(10, 1))[0] == "stem.1.bias"  # conv without bias -> BatchNorm
    assert first_bias(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)))[0] == "0.bias"
    freeze = FirstBiasFreeze(FastNet(10, 1), 2)
    freeze(0), freeze(1)
    assert freeze.bias.requires_grad
    freeze(2)
    assert not freeze.bias.requires_grad and freeze.bias.grad is None


# -- --augment flip-alternate ---------------------------------------------------------------------------
def _flip_loader(n: int = 64, world: int = 1, rank: int = 0) -> tuple[InMemoryLoader, torch.Tensor]:
    cache = torch.randint(0, 256, (n, 1, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    pre = Preprocess(img_size=5, channels=1, mean=(0.0,), std=(1.0,))
    loader = InMemoryLoader(cache, torch.arange(n), pre, 16, train=True, augment="flip-alternate", seed=3,
                            max_shift=0, rank=rank, world=world)
    return loader, cache


def _flipped(loader: InMemoryLoader, cache: torch.Tensor, epoch: int) -> dict[int, bool]:
    loader.set_epoch(epoch)
    out = {}
    for x, y in loader:
        for img, i in zip(x, y.tolist()):
            plain, mirror = cache[i].float() / 255, cache[i].float().flip(-1) / 255
            assert torch.allclose(img, plain) or torch.allclose(img, mirror)
            out[i] = torch.allclose(img, mirror)
    return out


def test_alternating_flips_mirror_exactly_the_complement_in_the_next_epoch() -> None:
    loader, cache = _flip_loader()
    e0, e1, e2, e3 = (_flipped(loader, cache, e) for e in range(4))
    assert len(e0) == 64 and 16 <= sum(e0.values()) <= 48  # a seeded random half
    assert all(e1[i] != e0[i] for i in e0)  # every image the other way round in the next epoch
    assert e2 == e0 and e3 == e1
    other, _ = _flip_loader(world=2, rank=1)  # a rank's share of the same global batches, same flips
    assert all(e0[i] == f for i, f in _flipped(other, cache, 0).items())


# -- --tta multicrop ------------------------------------------------------------------------------------
def test_multicrop_tta_is_airbenchs_weighted_six_views() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    x = torch.randn(2, 1, 6, 6)
    down_right, up_left = [1, 0, 1, 2, 3, 4], [1, 2, 3, 4, 5, 4]  # reflect-padded rows/columns, cropped

    def shift(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
        return t[..., idx, :][..., idx]

    by_hand = [x, x.flip(-1), shift(x, down_right), shift(x, down_right).flip(-1), shift(x, up_left),
               shift(x, up_left).flip(-1)]
    assert all(torch.equal(a, b) for a, b in zip(views(x, "multicrop"), by_hand, strict=True))
    with torch.no_grad():
        p = [model(v).softmax(1) for v in by_hand]
        expected = 0.25 * (p[0] + p[1]) + 0.125 * (p[2] + p[3] + p[4] + p[5])
        torch.testing.assert_close(tta_probs(model, x, "multicrop"), expected)
        torch.testing.assert_close(tta_probs(model, x, "flip"), (p[0] + p[1]) / 2)


# -- --selective-backprop -----------------------------------------------------------------------------------
def test_selective_backprop_keeps_the_highest_loss_images() -> None:
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(10, 4, generator=g), torch.randint(0, 4, (10,), generator=g)
    losses = F.cross_entropy(logits, y, reduction="none")
    for fraction, n in ((0.5, 5), (0.25, 3), (0.01, 1)):  # ceil(fraction x 10), at least one
        keep = SelectiveBackprop(fraction, 0).hardest(logits, y)
        assert keep.tolist() == losses.argsort(descending=True)[:n].tolist()
    assert not SelectiveBackprop(0.5, 2).applies(1) and SelectiveBackprop(0.5, 2).applies(2)
    # at the batch users train with (256, fmnist-fast's): the 128 hardest of a bf16 forward's logits
    logits, y = torch.randn(256, 10, generator=g).bfloat16(), torch.randint(0, 10, (256,), generator=g)
    keep = SelectiveBackprop(0.5, 0).hardest(logits, y)
    losses = F.cross_entropy(logits.float(), y, reduction="none")
    assert len(keep) == 128 and losses[keep].min() >= losses.sort(descending=True).values[127]


def test_selective_backprop_scores_the_batch_then_trains_on_its_hard_part(shapes32: Path, tmp_path: Path) -> None:
    """Every forward of the model during training: epoch 1 trains on whole batches of 8; from epoch 2 each batch
    is scored without gradients, then 4 of its images train."""
    from torchcls.training import train

    cfg = tiny_config(shapes32, tmp_path, "sb", epochs=2)
    cfg.model.name, cfg.data.val_fraction, cfg.governance.lineage = "fastnet", 0.25, False
    cfg.train.channels_last, cfg.precision.precision = False, "fp32"  # (no timed trial: its forwards are not these)
    cfg.optim.selective_backprop, cfg.optim.selective_backprop_after_epochs = 0.5, 1
    seen = []

    def record(module, args, output) -> None:
        if isinstance(module, FastNet) and module.training:
            seen.append((torch.is_grad_enabled(), len(args[0])))

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        result = train(cfg)
    finally:
        hook.remove()
    assert result.steps == 6  # 24 training images, 3 steps an epoch
    assert seen == [(True, 8)] * 3 + [(False, 8), (True, 4)] * 3


# -- the options in config.toml, on the command line, and a run using all of them -------------------------
ALL = ["--model", "fastnet", "--init", "whiten,dirac", "--freeze-first-conv", "--bn-bias-lr-scale", "64",
       "--freeze-first-bias-after-epochs", "1", "--lookahead", "3", "--lookahead-alpha", "0.5", "--augment",
       "flip-alternate", "--whiten-eps", "0.001", "--selective-backprop", "0.25", "--selective-backprop-after-epochs",
       "2"]


def test_the_options_are_flags_and_round_trip_through_config_toml(tmp_path: Path) -> None:
    cfg = config_from_args(build_parser().parse_args(["train", *ALL]))
    assert (cfg.model.init, cfg.model.freeze_first_conv, cfg.model.whiten_eps) == ("whiten,dirac", True, 1e-3)
    assert (cfg.optim.bn_bias_lr_scale, cfg.optim.freeze_first_bias_after_epochs) == (64.0, 1)
    assert (cfg.optim.lookahead, cfg.optim.lookahead_alpha, cfg.data.augment) == (3, 0.5, "flip-alternate")
    assert (cfg.optim.selective_backprop, cfg.optim.selective_backprop_after_epochs) == (0.25, 2)
    cfg.save_toml(tmp_path / "config.toml")
    assert load_toml(tmp_path / "config.toml").to_dict() == cfg.to_dict()
    default = Config()  # off unless asked for: a plain optimizer, not timm's Lookahead
    assert (default.model.init, default.model.freeze_first_conv, default.optim.bn_bias_lr_scale,
            default.optim.freeze_first_bias_after_epochs, default.optim.lookahead,
            default.optim.selective_backprop) == ("", False, 1.0, 0, 0, 0.0)
    assert not hasattr(build_optimizer(nn.Linear(2, 2), default.optim), "sync_lookahead")


@pytest.fixture(scope="module")
def shapes32(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("opts")
    make_image_folder(root, per_class=16)  # 32 images, 24 of them for training: 3 steps an epoch of 8
    return root


def _all_options(data: Path, out: Path, name: str) -> Config:
    cfg = tiny_config(data, out, name, epochs=2)
    cfg.model.name, cfg.model.init, cfg.model.freeze_first_conv = "fastnet", "whiten,dirac", True
    cfg.optim.optimizer, cfg.optim.lr, cfg.optim.weight_decay = "sgd", 0.05, 5e-4
    cfg.optim.bn_bias_lr_scale, cfg.optim.freeze_first_bias_after_epochs = 64.0, 1
    cfg.optim.lookahead, cfg.optim.lookahead_alpha = 2, 0.5
    cfg.optim.selective_backprop, cfg.optim.selective_backprop_after_epochs = 0.5, 1
    cfg.data.augment, cfg.data.in_memory, cfg.data.val_fraction = "flip-alternate", "on", 0.25
    cfg.governance.lineage = False
    return cfg


@pytest.mark.slow
def test_a_run_with_every_option_resumes_bit_for_bit_from_its_config_toml(shapes32: Path, tmp_path: Path) -> None:
    from torchcls.checkpoint.files import load_training_state
    from torchcls.evaluation.evaluator import evaluate
    from torchcls.events import CheckpointSaved, subscribe
    from torchcls.training import train
    from torchcls.training.rundir import read_metrics

    epoch_1 = {}  # the weights checkpointed at the end of epoch 1 (step 3, after its Lookahead sync)
    stop = subscribe(CheckpointSaved, lambda e: epoch_1.update(load_file(e.path)) if e.step == 3 and
                     e.run_path.name == "full" else None)
    try:
        full = train(_all_options(shapes32, tmp_path, "full"))
    finally:
        stop()
    cut_cfg = _all_options(shapes32, tmp_path, "cut")

    def interrupt(step: int) -> None:
        if step == 5:  # mid-epoch 2: the bias frozen, a Lookahead sync (step 4) behind and one (step 6) ahead
            raise KeyboardInterrupt

    assert train(cut_cfg, callbacks=[interrupt]).interrupted
    resumed_cfg = load_toml(tmp_path / "cut" / "config.toml")  # what `torchcls train --config ... --resume` reads
    assert (resumed_cfg.optim.lookahead, resumed_cfg.model.init) == (2, "whiten,dirac")
    resumed_cfg.run.resume = True
    resumed = train(resumed_cfg)
    assert resumed.steps == full.steps == 6  # 24 training images: 3 steps an epoch
    a, b = load_file(full.last_checkpoint), load_file(resumed.last_checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [[r["train_loss"] for r in read_metrics(run) if r["kind"] == "epoch"] for run in (full.run_dir,
                                                                                                resumed.run_dir)]
    assert losses[0] == losses[1]
    state = load_training_state(tmp_path / "full" / "checkpoints" / "last.state.safetensors")["optimizer"]
    assert any("lookahead_slow_buff" in s for s in state["state"].values())  # the slow weights are saved
    assert all(g["lookahead_k"] == 2 and g["lookahead_step"] == 6 for g in state["param_groups"])
    # The first conv's (whitened) weight never trains; the stem BatchNorm's bias not after epoch 1; the rest does
    assert torch.equal(epoch_1["stem.0.weight"], a["stem.0.weight"])
    assert torch.equal(epoch_1["stem.1.bias"], a["stem.1.bias"])
    assert not torch.equal(epoch_1["stem.1.weight"], a["stem.1.weight"])
    result = evaluate(full.run_dir, split="val", tta="multicrop")
    assert result["tta"] == "multicrop" and 0.0 <= result["top1"] <= 1.0


def test_the_options_refuse_what_they_are_not_for(shapes32: Path, tmp_path: Path) -> None:
    from torchcls.training import train

    cfg = _all_options(shapes32, tmp_path, "off")
    cfg.data.in_memory = "off"
    with pytest.raises(UserError, match="flip-alternate"):
        train(cfg)
    assert not (tmp_path / "off").exists()  # refused before the first step: nothing left behind
    cfg = _all_options(shapes32, tmp_path, "ddp")
    cfg.parallel.parallel = "ddp"
    with pytest.raises(UserError, match="for one process"):
        train(cfg)
    cfg = _all_options(shapes32, tmp_path, "pre")
    cfg.model.pretrained = str(tmp_path / "weights.safetensors")
    with pytest.raises(UserError, match="give one of the two"):
        train(cfg)
    for name, change, match in (
            ("frac", {"selective_backprop": 1.0}, r"selective_backprop = 1.0 is outside the allowed range \[0, 1\)"),
            ("after", {"selective_backprop_after_epochs": -1},
             "selective_backprop_after_epochs = -1 is outside the allowed range")):
        cfg = _all_options(shapes32, tmp_path, name)
        vars(cfg.optim).update(change)
        with pytest.raises(UserError, match=match):
            train(cfg)
    cfg = _all_options(shapes32, tmp_path, "mix")
    cfg.data.mixup = 0.2
    with pytest.raises(UserError, match="its one label, on one process: leave it at 0 with --mixup/--cutmix"):
        train(cfg)
    cfg = tiny_config(shapes32, tmp_path, "sb-ddp")
    cfg.optim.selective_backprop, cfg.parallel.parallel = 0.5, "ddp"
    with pytest.raises(UserError, match="leave it at 0 with --parallel ddp"):
        train(cfg)
    assert not any((tmp_path / n).exists() for n in ("frac", "after", "mix", "sb-ddp"))


def test_resume_refuses_another_lookahead(tmp_path: Path) -> None:
    from torchcls.training.resume_options import option_changes

    saved = tmp_path / "config.toml"
    Config().save_toml(saved)
    cfg = Config()
    cfg.optim.lookahead = 5
    with pytest.raises(UserError, match="--lookahead 0 -> 5"):
        option_changes(saved, cfg)
    cfg = Config()
    cfg.optim.freeze_first_bias_after_epochs = 2  # applied at each epoch start: may change on resume
    assert option_changes(saved, cfg) == {"optim.freeze_first_bias_after_epochs": (0, 2)}

"""Optimizers (timm's factory), parameter groups (no_weight_decay, layer decay, head lr), --freeze,
the schedules (--sched) and --class-weights: real models, real steps, small sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import tiny_config
from torchcls.checkpoint.files import load_training_state
from torchcls.config import OptimConfig
from torchcls.errors import UserError
from torchcls.models import ModelSpec, create_model
from torchcls.training.class_weights import class_weights, loss_weights
from torchcls.training.freeze import apply_freeze
from torchcls.training.optim import build_optimizer, build_scheduler, warmup_cosine
from torchcls.training.resume_options import apply_optim_changes

OPTIMIZERS = ("adamw", "sgd", "adam", "lamb", "lion", "lars", "rmsprop", "adopt")


def _smallnet(classes: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return create_model(ModelSpec("smallnet", classes, 1, 28))


def _step(model: nn.Module, optimizer, scheduler=None, steps: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return loss


def _scale_of(optimizer) -> dict[int, float]:
    return {id(p): g["lr_scale"] for g in optimizer.param_groups for p in g["params"]}


# -- optimizers and groups ----------------------------------------------------------------------
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_builds_and_steps(name):
    model = _smallnet()
    optimizer = build_optimizer(model, OptimConfig(optimizer=name, lr=1e-3))
    before = [p.detach().clone() for p in model.parameters()]
    loss = _step(model, optimizer, build_scheduler(optimizer, OptimConfig(optimizer=name), 5, 1), steps=2)
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for n, p in model.named_parameters():  # norms and biases are not decayed, conv/linear weights are
        assert (id(p) in decayed) == (p.ndim > 1), n


def test_adamw_and_sgd_keep_todays_settings():
    model = _smallnet()
    sgd = build_optimizer(model, OptimConfig(optimizer="sgd", momentum=0.8, weight_decay=0.01))
    assert type(sgd) is torch.optim.SGD and sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.8
    assert sorted(g["weight_decay"] for g in sgd.param_groups) == [0.0, 0.01]
    adamw = build_optimizer(model, OptimConfig())
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["fused"]  # fused CPU kernel
    assert sum(len(g["params"]) for g in adamw.param_groups) == len(list(model.parameters()))


def test_vit_no_weight_decay_and_layer_decay():
    vit = create_model(ModelSpec("vit_tiny_patch16_224", 5, 3, 32))
    params = dict(vit.named_parameters())
    optimizer = build_optimizer(vit, OptimConfig(weight_decay=0.05))
    wd = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert wd[id(params["pos_embed"])] == 0.0 and wd[id(params["cls_token"])] == 0.0
    assert wd[id(params["blocks.0.attn.qkv.weight"])] == 0.05
    optimizer = build_optimizer(vit, OptimConfig(layer_decay=0.5))
    scale = {n: _scale_of(optimizer)[id(p)] for n, p in params.items()}
    chain = [scale["pos_embed"], scale["blocks.0.attn.qkv.weight"], scale["blocks.5.mlp.fc1.weight"],
             scale["blocks.11.mlp.fc1.weight"], scale["head.weight"]]
    assert chain == sorted(chain) and len(set(chain)) == 5 and chain[-1] == 1.0
    assert scale["blocks.1.attn.qkv.weight"] == pytest.approx(2 * scale["blocks.0.attn.qkv.weight"])


def test_layer_decay_fallback_and_head_lr_on_smallnet():
    model = _smallnet()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, layer_decay=0.5, head_lr=10.0))
    scale = {n: _scale_of(optimizer)[id(p)] for n, p in model.named_parameters()}
    assert scale["stem.0.weight"] == 0.5 ** 4 and scale["stages.0.conv1.weight"] == 0.5 ** 3
    assert scale["stages.2.conv1.weight"] == 0.5 and scale["head.3.weight"] == 10.0
    scheduler = build_scheduler(optimizer, OptimConfig(lr=1e-2, warmup_epochs=0.0), 10, 1)
    lr = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert lr[id(model.head[3].weight)] == pytest.approx(1e-2 * 10)  # the schedule applies lr_scale
    assert lr[id(model.stem[0].weight)] == pytest.approx(1e-2 * 0.5 ** 4)
    assert len(scheduler.get_last_lr()) == len(optimizer.param_groups)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, head_lr=10.0))
    scheduler = build_scheduler(optimizer, OptimConfig(warmup_epochs=0.0), 10, 1)
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-2)  # group 0 (what steps log) is at scale 1
    assert sorted(g["lr_scale"] for g in optimizer.param_groups) == [1.0, 1.0, 10.0, 10.0]
    with pytest.raises(UserError, match="early-exit"):
        build_optimizer(create_model(ModelSpec("ee/smallnet", 4, 1, 28)), OptimConfig(layer_decay=0.7))
    with pytest.raises(UserError, match="--layer-decay"):
        build_optimizer(model, OptimConfig(layer_decay=1.5))


def test_resume_refuses_another_optimizer_or_grouping_and_applies_weight_decay_from_zero(tmp_path):
    from torchcls.training.resume_options import option_changes

    cfg = tiny_config(tmp_path, tmp_path)
    cfg.optim.weight_decay = 0.0
    cfg.save_toml(tmp_path / "config.toml")
    for key, value in (("optimizer", "lamb"), ("head_lr", 10.0), ("layer_decay", 0.7)):
        changed = tiny_config(tmp_path, tmp_path)
        setattr(changed.optim, key, value)
        with pytest.raises(UserError, match=key.replace("_", "-")):
            option_changes(tmp_path / "config.toml", changed)
    model = _smallnet()  # --weight-decay 0 -> 0.05 on resume: the saved optimizer state still fits
    saved = build_optimizer(model, OptimConfig(weight_decay=0.0)).state_dict()
    resumed = build_optimizer(model, OptimConfig(weight_decay=0.05))
    built = [g["weight_decay"] for g in resumed.param_groups]
    resumed.load_state_dict(saved)
    assert all(g["weight_decay"] == 0.0 for g in resumed.param_groups)  # the checkpoint's, until applied
    apply_optim_changes(resumed, None, {"optim.weight_decay": (0.0, 0.05)}, schedule_restored=True,
                        built_weight_decays=built)
    decayed = {id(p) for g in resumed.param_groups if g["weight_decay"] == 0.05 for p in g["params"]}
    assert {id(model.head[-1].weight)} <= decayed and id(model.head[-1].bias) not in decayed  # biases: none


# -- freeze ---------------------------------------------------------------------------------------
def test_freeze_backbone_trains_only_the_head():
    model = _smallnet()
    summary = apply_freeze(model, "backbone")
    assert "BatchNorm" in summary
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    model.train()  # the trainer calls this after every validation: frozen BatchNorms must stay in eval mode
    _step(model, optimizer, steps=2)
    for k, v in model.state_dict().items():  # weights and running statistics, bit for bit
        if not k.startswith("head."):
            assert torch.equal(v, state[k]), k
    assert not torch.equal(model.head[3].weight, state["head.3.weight"])


def test_freeze_stages_and_bad_values():
    model = _smallnet()
    apply_freeze(model, "stages:2")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("stages.2.", "head.")) for n in trainable)
    assert "stages.2.conv1.weight" in trainable
    for bad, message in (("stages:0", "from 1 to 3"), ("stages:99", "from 1 to 3"), ("stages:x", "from 1 to 3"),
                         ("everything", "backbone")):
        with pytest.raises(UserError, match=message):
            apply_freeze(_smallnet(), bad)
    with pytest.raises(UserError, match="early-exit"):
        apply_freeze(create_model(ModelSpec("ee/smallnet", 4, 1, 28)), "stages:1")
    resnet = create_model(ModelSpec("resnet18", 4, 3, 32))  # timm: stages from its group_matcher
    apply_freeze(resnet, "stages:4")
    assert {n for n, p in resnet.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}


# -- schedules ------------------------------------------------------------------------------------
def _curve(sched: str, steps: int = 30, optimizer: str = "adamw", **kw) -> tuple[list[float], object, object]:
    cfg = OptimConfig(optimizer=optimizer, sched=sched, lr=0.1, warmup_epochs=0.5, **kw)
    opt = build_optimizer(_smallnet(), cfg)
    scheduler = build_scheduler(opt, cfg, steps_per_epoch=10, epochs=3)
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
    return lrs, scheduler, opt


def test_cosine_keeps_the_previous_curve():
    lrs, _, _ = _curve("cosine")
    opt = torch.optim.SGD(_smallnet().parameters(), lr=0.1)
    old = warmup_cosine(opt, 5, 30)
    for step, lr in enumerate(lrs):
        assert abs(lr - old.get_last_lr()[0]) < 1e-6, step
        opt.step()  # no gradients: nothing changes, torch only wants this order
        old.step()


def test_step_onecycle_and_plateau_shapes():
    lrs, _, _ = _curve("step")
    assert lrs[5:10] == [pytest.approx(0.1)] * 5 and lrs[10:20] == [pytest.approx(0.01)] * 10
    assert lrs[20:] == [pytest.approx(0.001)] * 10
    lrs, _, opt = _curve("onecycle", optimizer="sgd", steps=29)
    assert lrs[0] == pytest.approx(0.1 / 25) and max(lrs) == pytest.approx(0.1) and lrs[-1] < 1e-3
    assert lrs.index(max(lrs)) == 4 and opt.param_groups[0]["momentum"] == pytest.approx(0.9)
    lrs, plateau, opt = _curve("plateau", steps=10)
    assert lrs[:5] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1])
    for loss in (1.0, 0.5, 0.6, 0.6):  # best 0.5, then two epochs without improvement: patience
        plateau.epoch_end(loss)
        assert plateau.get_last_lr()[0] == pytest.approx(0.1)
    plateau.epoch_end(0.6)
    plateau.step()
    assert plateau.get_last_lr()[0] == pytest.approx(0.01)


def test_linear_warms_up_then_falls_straight_to_zero():
    lrs, _, _ = _curve("linear")  # 5 warm-up steps of 30, then 25 steps down
    assert lrs[:5] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1])
    assert lrs[5:] == pytest.approx([0.1 * (1 - k / 25) for k in range(25)])  # equal steps: a straight line
    cosine, _, _ = _curve("cosine")
    assert lrs[10] < cosine[10] and lrs[25] > cosine[25]  # below the cosine early, above it late


@pytest.mark.parametrize("sched", ("cosine", "linear", "step", "onecycle", "plateau"))
def test_schedule_state_round_trip_and_lr_change_on_resume(sched, tmp_path):
    _, scheduler, opt = _curve(sched, steps=12)
    if sched == "plateau":
        for loss in (1.0, 2.0, 2.0, 2.0):
            scheduler.epoch_end(loss)
    path = tmp_path / "s.pt"
    torch.save({"opt": opt.state_dict(), "sched": scheduler.state_dict()}, path)
    saved = torch.load(path, weights_only=True)  # checkpoints are read like this
    cfg = OptimConfig(sched=sched, lr=0.2, warmup_epochs=0.5)  # resumed with --lr doubled
    fresh_opt = build_optimizer(_smallnet(), cfg)
    fresh = build_scheduler(fresh_opt, cfg, 10, 3)
    fresh_opt.load_state_dict(saved["opt"])
    fresh.load_state_dict(saved["sched"])
    assert fresh.get_last_lr() == pytest.approx(scheduler.get_last_lr())
    apply_optim_changes(fresh_opt, fresh, {"optim.lr": (0.1, 0.2)}, schedule_restored=True, built_weight_decays=[])
    for _ in range(10):
        assert fresh.get_last_lr()[0] == pytest.approx(2 * scheduler.get_last_lr()[0])
        scheduler.step()
        fresh.step()


# -- class weights --------------------------------------------------------------------------------
def test_class_weights_from_the_training_split():
    targets = torch.tensor([0] * 6 + [1] * 3 + [2] * 1 + [3] * 5)
    data = SimpleNamespace(images=SimpleNamespace(targets=targets), classes=["a", "b", "c", "d"],
                           train=SimpleNamespace(indices=torch.arange(10)))  # the 5 images of d are validation
    weights = class_weights(data)
    assert weights.tolist() == pytest.approx([10 / (4 * 6), 10 / (4 * 3), 10 / (4 * 1), 0.0])
    cfg = tiny_config(".", ".")
    assert loss_weights(cfg, data, None, torch.device("cpu")) is None  # --class-weights none
    cfg.optim.class_weights = "auto"
    assert torch.equal(loss_weights(cfg, data, None, torch.device("cpu")), weights)
    with pytest.raises(UserError, match="mixup"):
        loss_weights(cfg, data, object(), torch.device("cpu"))
    cfg.data.balanced_sampler = True
    with pytest.raises(UserError, match="balanced-sampler"):
        loss_weights(cfg, data, None, torch.device("cpu"))


# -- runs -----------------------------------------------------------------------------------------
def test_plateau_and_frozen_backbone_in_a_run(tmp_path, shapes_dir):
    from torchcls.training import train

    cfg = tiny_config(shapes_dir, tmp_path, "plateau", epochs=2)
    cfg.optim.sched, cfg.model.freeze, cfg.optim.class_weights = "plateau", "backbone", "auto"
    result = train(cfg)
    state = load_training_state(result.run_dir / "checkpoints" / "last.state.safetensors")
    assert state["scheduler"]["sched"] == "plateau" and state["scheduler"]["plateau"]["last_epoch"] == 2
    cfg = tiny_config(shapes_dir, tmp_path, "bad", epochs=1)
    cfg.model.freeze = "stages:9"
    with pytest.raises(UserError, match="stages"):
        train(cfg)
    assert not (tmp_path / "bad").exists()  # nothing left half-written


@pytest.mark.slow
def test_cli_lamb_with_step_schedule(tmp_path, shapes_dir):
    proc = subprocess.run([sys.executable, "-m", "torchcls", "train", "--data", str(shapes_dir), "--img-size", "32",
                           "--batch-size", "8", "--workers", "0", "--epochs", "1", "--no-progress",
                           "--optimizer", "lamb", "--sched", "step", "--head-lr", "5", "--freeze", "stages:1",
                           "--class-weights", "auto", "--out-dir", str(tmp_path), "--name", "lamb"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--freeze stages:1" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "lamb" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and steps[-1]["lr"] == pytest.approx(3e-3 * 0.01)  # after both drops
    assert any(r["kind"] == "epoch" for r in records)

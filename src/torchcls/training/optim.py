"""The optimizer, through timm's factory (timm.optim.create_optimizer_v2), and its parameter groups.

Groups come from timm's own grouping: no weight decay for 1-d parameters (norms), biases and what a
model names in no_weight_decay() (a ViT's pos_embed, cls_token); with --layer-decay F, timm's
layer-wise groups from the model's group_matcher (SmallNet and torchvision models, which have
none, get the stage map of models/parts.py: stem, stages, head). --head-lr F splits the classifier's
parameters into groups of their own, --bn-bias-lr-scale F the BatchNorm biases (already without weight
decay: the scale changes their step size alone; airbench decays them at wd / F, so that their decay per
step stays the others', which is not reproduced here). Each group carries `lr_scale` (timm's convention): its rate is
the schedule's value times lr_scale, which the schedule (training/schedule.py) applies.

adamw, adam and sgd use torch's fused kernels on CPU and CUDA: on CPU (2 threads) a fused AdamW step
took 0.16 ms for SmallNet and 28 ms for ResNet-18 against 2.4 / 138 ms for the default per-tensor
loop (foreach: no gain on CPU), and on CUDA the fused step can skip a non-finite update from a
device flag (precision.defer_checks) with no host synchronisation. timm's lamb, lion, lars, rmsprop
and adopt keep their own implementations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from torchcls.config import OptimConfig
from torchcls.errors import UserError
from torchcls.models.parts import head_parameter_ids, stage_map, unwrap
from torchcls.training.init import BATCHNORMS
from torchcls.training.schedule import LRSchedule, build_scheduler

FUSED = ("adamw", "adam", "sgd")  # torch optimizers with fused kernels
FUSED_DEVICES = ("cpu", "cuda")

__all__ = ["LRSchedule", "build_optimizer", "build_scheduler", "param_groups", "warmup_cosine"]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """cfg.optimizer over the trainable parameters of `model` (frozen ones are left out)."""
    from timm.optim import create_optimizer_v2

    groups = param_groups(model, cfg)
    extra = {"fused": True} if cfg.optimizer in FUSED and _fusable(groups) else {}
    # sgd is timm's Nesterov SGD; momentum reaches the optimizers that take one (sgd, lars, rmsprop).
    optimizer = create_optimizer_v2(groups, opt=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                    momentum=cfg.momentum, **extra)
    return with_lookahead(optimizer, cfg)


def with_lookahead(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.Optimizer:
    """--lookahead K: timm's Lookahead around `optimizer`. Its slow weights live in the inner optimizer's
    state ("lookahead_slow_buff") and its step count in the groups ("lookahead_step"), so its state_dict,
    which checkpoints save, holds them: a resumed run continues them exactly. timm's wrapper starts the slow
    weights at the first sync (step K) from the fast ones, so the first pull-back happens at step 2K."""
    if not cfg.lookahead:
        return optimizer
    from timm.optim import Lookahead

    return Lookahead(optimizer, alpha=cfg.lookahead_alpha, k=cfg.lookahead)


def _fusable(groups: list[dict]) -> bool:
    return all(p.device.type in FUSED_DEVICES and p.is_floating_point() for g in groups for p in g["params"])


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """timm's weight-decay (or layer-decay) groups, split for --head-lr, each with lr_scale."""
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    _check(cfg)
    net = unwrap(model)
    no_decay = set(net.no_weight_decay()) if callable(getattr(net, "no_weight_decay", None)) else set()
    if not any(p.requires_grad for p in net.parameters()):
        raise UserError("no parameter is left to train (all are frozen); check --freeze")
    if cfg.layer_decay and callable(getattr(net, "group_matcher", None)):
        groups = param_groups_layer_decay(net, weight_decay=cfg.weight_decay, layer_decay=cfg.layer_decay,
                                          no_weight_decay_list=no_decay)
    else:
        # Grouped as if decay were on: the same groups whatever --weight-decay, which a resume may change.
        groups = param_groups_weight_decay(net, weight_decay=1.0, no_weight_decay_list=no_decay)
        for g in groups:
            g["weight_decay"] = cfg.weight_decay if g["weight_decay"] else 0.0
        if cfg.layer_decay:  # models without a group_matcher: by stage, the head at rate 1
            groups = _split(groups, _stage_scales(net, cfg.layer_decay))
    if cfg.head_lr != 1.0:
        head = head_parameter_ids(net)
        groups = _split(groups, lambda p: cfg.head_lr if id(p) in head else 1.0)
    if cfg.bn_bias_lr_scale != 1.0:  # airbench's 64x: BatchNorm biases (no decay in any case) learn faster
        bn_biases = {id(m.bias) for m in net.modules() if isinstance(m, BATCHNORMS) and m.bias is not None}
        groups = _split(groups, lambda p: cfg.bn_bias_lr_scale if id(p) in bn_biases else 1.0)
    for g in groups:
        g.setdefault("lr_scale", 1.0)
        # Right before any schedule runs too; "initial_lr" is the unscaled base timm's schedulers start from.
        g["lr"], g["initial_lr"] = cfg.lr * g["lr_scale"], cfg.lr
    # A group at scale 1 first: the step records log group 0's rate, which is then --lr's schedule.
    return sorted(groups, key=lambda g: g["lr_scale"] != 1.0)


def _check(cfg: OptimConfig) -> None:
    if not 0.0 <= cfg.layer_decay <= 1.0:
        raise UserError(f"--layer-decay {cfg.layer_decay}: give a factor in (0, 1] (e.g. 0.75; each block further "
                        "from the head gets that times its successor's rate), or 0 for off")
    if not cfg.head_lr > 0.0:
        raise UserError(f"--head-lr {cfg.head_lr}: give a positive multiple of --lr (e.g. 10), or 1 for the same rate")
    if not (cfg.bn_bias_lr_scale > 0.0 and math.isfinite(cfg.bn_bias_lr_scale)):
        raise UserError(f"--bn-bias-lr-scale {cfg.bn_bias_lr_scale}: give a positive multiple of --lr (airbench: "
                        "64), or 1 for the same rate")
    if cfg.lookahead < 0 or (cfg.lookahead and not 0.0 < cfg.lookahead_alpha <= 1.0):
        raise UserError(f"--lookahead {cfg.lookahead} --lookahead-alpha {cfg.lookahead_alpha}: give K >= 1 steps "
                        "(0 = off) and an alpha in (0, 1] (e.g. --lookahead 5 --lookahead-alpha 0.5)")


def _stage_scales(net: nn.Module, decay: float) -> Callable[[nn.Parameter], float]:
    ids, stages = stage_map(net)
    by_param = {id(p): decay ** (stages + 1 - ids[n]) for n, p in net.named_parameters()}
    return lambda p: by_param[id(p)]


def _split(groups: list[dict], factor: Callable[[nn.Parameter], float]) -> list[dict]:
    """Each group split by `factor` of its parameters, lr_scale multiplied by it."""
    out = []
    for g in groups:
        parts: dict[float, list] = {}
        for p in g["params"]:
            parts.setdefault(factor(p), []).append(p)
        out += [{**g, "params": ps, "lr_scale": g.get("lr_scale", 1.0) * f} for f, ps in parts.items()]
    return out


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """The schedule before --sched (a LambdaLR): linear warm-up to the peak, cosine to zero. The cosine of
    build_scheduler follows it exactly; kept for callers that drive a plain torch optimizer."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

"""--freeze: train only part of a model, applied from outside its code before the optimizer is built.

backbone: every parameter but the classifier head's stops requiring gradients; stages:N: the stem
and the first N stages do (models/parts.py finds head and stages for every family). The BatchNorm
layers of the frozen part stay in eval mode: their running statistics are not updated, so the
frozen features are exactly the pretrained ones. model.train() (called by the trainer after every
validation) sets every module back to training mode, so a forward pre-hook on each frozen BatchNorm
puts it back into eval mode right before it runs; the model class is untouched and the hook
survives DDP, FSDP2 and torch.compile (which traces module hooks).

Must run before parallelize(): DDP registers its gradient hooks for the parameters that require
gradients when it wraps the model.
"""

from __future__ import annotations

from torch import nn

from torchcls.errors import UserError
from torchcls.models.parts import head_parameter_ids, stage_map, unwrap

VALID = "--freeze backbone (all but the classifier) or --freeze stages:N (the stem and the first N stages)"


def apply_freeze(model: nn.Module, spec: str) -> str | None:
    """Freeze per `spec` ('' = nothing); returns a one-line summary, or None when nothing is frozen."""
    spec = spec.strip()
    if not spec:
        return None
    net = unwrap(model)
    frozen = _frozen_names(net, spec)
    params = dict(net.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    bns = 0
    for module in net.modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and own and not any(p.requires_grad for p in own):
            module.register_forward_pre_hook(_keep_eval)
            bns += 1
    n_frozen = sum(params[n].numel() for n in frozen)
    total = sum(p.numel() for p in params.values())
    return (f"--freeze {spec}: {n_frozen:,} of {total:,} parameters frozen ({len(frozen)} tensors), "
            f"{bns} BatchNorm layer(s) kept in eval mode")


def _keep_eval(module: nn.Module, args) -> None:
    module.training = False  # running statistics are used, not updated


def _frozen_names(net: nn.Module, spec: str) -> list[str]:
    names = [n for n, _ in net.named_parameters()]
    if spec == "backbone":
        head = head_parameter_ids(net)
        return [n for n, p in net.named_parameters() if id(p) not in head]
    if spec.startswith("stages:"):
        count = spec.removeprefix("stages:").strip()
        ids, stages = stage_map(net)
        if not count.isdigit() or not 1 <= int(count) <= stages:
            raise UserError(f"--freeze {spec}: this model ({type(net).__name__}) has {stages} stages after its stem; "
                            f"give N from 1 to {stages} (stages:{stages} leaves only the head trainable), or "
                            "--freeze backbone")
        return [n for n in names if ids[n] <= int(count)]
    raise UserError(f"--freeze {spec!r} names no part of the model; use {VALID}, or leave it empty")

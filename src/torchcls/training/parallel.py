"""Parallelism is applied to a built model from outside its code (as torchtitan does).

`parallelize(model, cfg)` wraps the model for the process group torchrun set up
(train/distributed.py): DDP replicates it and averages gradients; FSDP2 (`fully_shard`)
shards parameters, gradients and optimizer state across ranks, one FSDP unit per block so
only one block's full parameters exist at a time. Which modules are "blocks" is decided per
model family below; the model classes themselves know nothing of this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from torchcls.config import ParallelConfig
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.precision.dtypes import DTYPES


def _fsdp_dtype(name: str) -> torch.dtype | None:
    """None for fp32: FSDP2 keeps the parameters' own dtype (fp32) instead of casting them."""
    return None if name == "fp32" else DTYPES[name]


def parallelize(model: nn.Module, cfg: ParallelConfig, device: torch.device | None = None) -> nn.Module:
    """`device`: where training runs, needed when the model is still on the meta device."""
    if cfg.parallel == "none":
        return model
    if not dist.is_initialized():
        raise UserError(f"--parallel {cfg.parallel} needs a process group: start the run with torchrun")
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.parallel == "ddp":
        return apply_ddp(model)
    if cfg.parallel == "fsdp2":
        return apply_fsdp2(model, cfg, device or next(model.parameters()).device)
    raise UserError(f"--parallel {cfg.parallel}: choose none, ddp or fsdp2")


def apply_ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    on_gpu = next(model.parameters()).is_cuda
    # broadcast_buffers (the default) copies rank 0's BatchNorm stats to all ranks at each forward.
    return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if on_gpu else None)


def apply_fsdp2(model: nn.Module, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not all(p.is_contiguous() for p in model.parameters()):
        raise UserError("--parallel fsdp2 shards contiguous parameters only (PyTorch's FSDP2): drop "
                        "--channels-last, or use --parallel ddp, which keeps it")
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if cfg.fsdp_param_dtype != "fp32" and has_bn:
        raise UserError(f"--fsdp-param-dtype {cfg.fsdp_param_dtype}: this model has BatchNorm layers, whose "
                        "fp32 running statistics cannot mix with low-precision weights in batch_norm; keep "
                        "--fsdp-param-dtype fp32 and use --precision bf16 (autocast) for the compute instead")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = dict(mesh=mesh, reshard_after_forward=cfg.reshard_after_forward,
                  mp_policy=MixedPrecisionPolicy(param_dtype=_fsdp_dtype(cfg.fsdp_param_dtype),
                                                 reduce_dtype=_fsdp_dtype(cfg.fsdp_reduce_dtype)),
                  offload_policy=CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy())
    family, blocks = find_blocks(model)
    if not blocks:
        console.print(f"[yellow]fsdp2: no per-block rule for {type(model).__name__}; sharding it as one unit "
                      "(all its parameters are gathered at once)[/]")
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)  # the root: stem, head and anything outside the blocks
    console.print(f"fsdp2: {len(blocks)} {family} block(s) + root sharded over {mesh.size()} rank(s)")
    return model


def _smallnet_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.stages)


def _resnet_blocks(model: nn.Module) -> list[nn.Module]:
    # timm and torchvision ResNets: layer1..layer4, each a Sequential of residual blocks.
    return [block for i in range(1, 5) for block in getattr(model, f"layer{i}")]


def _transformer_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)  # timm ViT / DeiT / EVA ...: a Sequential of transformer blocks


def _convnet_stages(model: nn.Module) -> list[nn.Module]:
    return list(model.stages)  # timm ConvNeXt, RegNet, EfficientFormer...: one unit per stage


# Ordered: the first rule whose test matches the model decides.
FAMILIES: list[tuple[str, Callable[[nn.Module], bool], Callable[[nn.Module], list[nn.Module]]]] = [
    ("smallnet", lambda m: type(m).__name__ == "SmallNet", _smallnet_blocks),
    ("resnet", lambda m: all(isinstance(getattr(m, f"layer{i}", None), nn.Sequential) for i in range(1, 5)),
     _resnet_blocks),
    ("transformer", lambda m: isinstance(getattr(m, "blocks", None), (nn.Sequential, nn.ModuleList)),
     _transformer_blocks),
    ("stage", lambda m: isinstance(getattr(m, "stages", None), (nn.Sequential, nn.ModuleList)), _convnet_stages),
]


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    for family, matches, blocks in FAMILIES:
        if matches(model):
            return family, blocks(model)
    return "no", []


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Whether the backward inside all-reduces (DDP) or reduce-scatters (FSDP2) the gradients: not on the
    inner micro-batches of --accum-steps, whose gradients only add up locally until the last one."""
    if enabled:
        yield
        return
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield

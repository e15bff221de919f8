"""FSDP2 without the whole model on every rank.

Only rank 0 builds the model with real weights, on the CPU; every rank builds it on the meta
device (shapes, no storage), shards it with `parallelize`, allocates just its own shards and
receives their values from rank 0 (`set_model_state_dict(..., broadcast_from_rank0=True)`).
The weights are exactly those of a seeded single-process build, and the global RNG continues
from the same state, so runs stay reproducible across world sizes. What no rank holds any
more is the unsharded model on its device (or, on CPU, one copy of it per rank in host RAM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchcls.config import ParallelConfig, PrecisionConfig
from torchcls.console import console


@dataclass
class Rank0Weights:
    """On rank 0, the real model's state; on the other ranks, nothing (they receive it)."""
    state: dict[str, torch.Tensor] | None
    buffers: dict[str, torch.Tensor] | None  # non-persistent buffers: not in the state dict, still needed


def applies(cfg: ParallelConfig, precision: PrecisionConfig, has_model_hooks: bool) -> bool:
    # A governance model hook runs once on a real model and may change its weights, so such runs
    # keep building the whole model on every rank.
    # TransformerEngine's layers choose their own device when built, so they are left out too.
    te = precision.precision == "fp8" and precision.fp8_backend == "te"
    return cfg.parallel == "fsdp2" and cfg.fsdp_init_from_rank0 and not has_model_hooks and not te


def build_on_meta(build: Callable[[], nn.Module], rank: int) -> tuple[nn.Module, Rank0Weights]:
    """The model on the meta device on every rank, and rank 0's real weights."""
    source = Rank0Weights(None, None)
    if rank == 0:
        real = build()
        state = real.state_dict()
        source = Rank0Weights(dict(state), {n: b for n, b in real.named_buffers() if n not in state})
    rng = torch.get_rng_state()
    with torch.device("meta"):
        model = build()
    # Building consumed random numbers on rank 0 only: every rank continues from rank 0's RNG
    # state after its real build, as if each had built the model itself.
    dist.broadcast(rng, src=0)
    torch.set_rng_state(rng)
    return model, source


def materialize(model: nn.Module, source: Rank0Weights, device: torch.device, cfg: ParallelConfig) -> None:
    """Allocate each rank's shards of the sharded meta model and fill them with rank 0's weights
    (then dropped, so rank 0 does not keep the whole model for the rest of the run)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=torch.device("cpu") if cfg.fsdp_cpu_offload else device)
    state = source.state or {}  # emptied in place by set_model_state_dict
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    persistent = model.state_dict().keys()
    for name, buf in model.named_buffers():
        if name not in persistent:
            if source.buffers is not None:
                buf.copy_(source.buffers[name])
            dist.broadcast(buf, src=0)
    source.state = source.buffers = None
    console.print(f"fsdp2: rank 0 built the model; {dist.get_world_size()} rank(s) hold only their shards")

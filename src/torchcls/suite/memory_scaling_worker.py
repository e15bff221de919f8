"""One `bench memory` configuration: a torchrun job (one process per rank) that trains a few steps.

Every rank builds the model through torchcls's registry, applies `parallelize` exactly as
`torchcls train --parallel ...` does, runs AdamW steps on random images and records, per rank,
what train/memory.py records in a training run (parameter, gradient and optimizer-state bytes,
peak RSS / CUDA allocator peaks) plus two inputs of the analytic model: the activation bytes
one sample keeps for backward, and the largest FSDP unit (the most parameters unsharded at once).
Rank 0 writes the list of per-rank records as JSON to --out.

    torchrun --nproc-per-node N -m torchcls.suite.memory_scaling_worker --model M --parallel fsdp2 --out F
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn


def activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one forward pass (activations), counted
    once per storage; parameters (and views of them, e.g. a transposed weight) are not activations."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), y)
    del loss
    return sum(saved.values())


def largest_unit_bytes(model: nn.Module) -> int:
    """Full (unsharded) parameter bytes of the biggest FSDP unit: FSDP2 gathers one unit at a time
    (plus the next one, prefetched). Without FSDP, the whole model counts as one unit."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)] or [model]
    inner = {id(p) for u in units if u is not model for p in u.parameters()}

    def own(unit: nn.Module) -> int:  # parameters not managed by a nested unit
        return sum(p.numel() * p.element_size() for p in unit.parameters()
                   if unit is not model or id(p) not in inner)

    return max(own(u) for u in units)


def run(args: argparse.Namespace) -> None:
    import gc
    import os

    import psutil

    from torchcls.config import Config
    from torchcls.models import ModelSpec, create_model
    from torchcls.training import distributed
    from torchcls.training.optim import build_optimizer
    from torchcls.training.parallel import parallelize
    from torchcls.training.rank_memory import measure, reset_peak_memory

    world = int(os.environ["WORLD_SIZE"])
    cfg = Config()
    cfg.parallel.parallel, cfg.data.batch_size = args.parallel, args.batch * world
    session = distributed.setup(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = create_model(ModelSpec(args.model, args.classes, 3, args.img_size)).to(device)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(args.batch, 3, args.img_size, args.img_size, device=device),
                torch.randint(0, args.classes, (args.batch,), device=device))

    per_sample = activation_bytes(model, *batch()) / args.batch  # before sharding: same on every rank
    model = parallelize(model, cfg.parallel)
    optimizer = build_optimizer(model, cfg.optim)
    gc.collect()
    before = {"rss_before_steps_bytes": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        before["cuda_allocated_before_steps_bytes"] = torch.cuda.memory_allocated()
    reset_peak_memory()  # the peak of the training steps, not of building the full model before sharding
    for _ in range(args.steps):
        x, y = batch()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    record = measure(model, optimizer, session) | {"activation_bytes_per_sample": per_sample,
                                                   "largest_unit_bytes": largest_unit_bytes(model)} | before
    ranks = session.gather_objects(record)
    if session.is_main:
        Path(args.out).write_text(json.dumps(ranks))
    session.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--parallel", choices=("ddp", "fsdp2"), required=True)
    p.add_argument("--batch", type=int, default=2, help="images per rank")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", required=True)
    from torchcls.errors import UserError

    try:
        run(p.parse_args())
    except UserError as e:  # the parent records the last stderr line as this configuration's error
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()

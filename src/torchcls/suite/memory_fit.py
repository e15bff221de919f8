"""The analytic per-rank memory model, and what fits on a (possibly heterogeneous) cluster.

Per rank, training memory is modelled as
    state       parameters + gradients + optimizer state: full size / world under FSDP2 (every
                tensor is sharded), full size under DDP (a replica per rank)
  + transient   FSDP2: the unsharded parameters of the unit being computed and of the one
                prefetched, plus one unit's unsharded gradients before their reduce-scatter
                (3 × the largest unit); DDP: its gradient buckets (a copy of the gradients)
  + activations the bytes autograd saves for backward, per sample × per-rank batch
  + overhead    runtime, CUDA context, kernels' workspaces: a fixed allowance (--overhead)
and a device is only filled to (1 - HEADROOM) of its size, leaving room for the caching
allocator's fragmentation. Ranks of one DDP/FSDP2 job all step together on equally sized
batches, so the rank with the least room sets the per-rank batch for every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchcls import sizes

HEADROOM = 0.10
MAX_SIZE = 2**50  # 1 PiB: more than any device's memory (or an --overhead on one)


def parse_size(text: str, option: str) -> int:
    """A memory size ('80GiB', '40 GB', '512MiB', '1.5g') in bytes, 0 to MAX_SIZE."""
    return sizes.parse_size(text, option, MAX_SIZE, "1PiB (memory_fit.MAX_SIZE)", "80GiB, 40GB or 512MiB",
                            zero=True)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass(frozen=True)
class RankModel:
    """The analytic model's inputs for one rank of one configuration."""

    state_bytes: float
    transient_bytes: float
    activation_bytes_per_sample: float

    def peak(self, batch: int, overhead: float) -> float:
        return self.state_bytes + self.transient_bytes + self.activation_bytes_per_sample * batch + overhead

    def max_batch(self, capacity: float, overhead: float) -> int:
        room = capacity * (1 - HEADROOM) - self.peak(0, overhead)
        if room < 0:
            return 0
        per_sample = self.activation_bytes_per_sample
        return math.floor(room / per_sample) if per_sample > 0 else 10**9


def transient_bytes(parallel: str, largest_unit_bytes: float, full_grad_bytes: float) -> float:
    return 3 * largest_unit_bytes if parallel == "fsdp2" else full_grad_bytes


def rank_model(parallel: str, world: int, rank: dict[str, Any]) -> RankModel:
    """From a measured rank record (suite/memory_scaling_worker.py + full sizes), at its world size or projected
    to another one: the state follows the sharding rule, the rest does not depend on the world size."""
    state = rank["full_state_bytes"] / (world if parallel == "fsdp2" else 1)
    return RankModel(state, transient_bytes(parallel, rank["largest_unit_bytes"], rank["full_grad_bytes"]),
                     rank["activation_bytes_per_sample"])


def capacities(device_memory: list[int], world: int) -> list[int]:
    """One size per rank, in rank order; a shorter list repeats (`80GiB,40GiB` at world 4 → 80, 40, 80, 40)."""
    return [device_memory[r % len(device_memory)] for r in range(world)]


def fit(parallel: str, world: int, models: list[RankModel], caps: list[int], overhead: float,
        projected: bool) -> dict[str, Any]:
    per_rank = [{"rank": r, "capacity_bytes": cap, "fixed_bytes": m.peak(0, overhead),
                 "max_batch": m.max_batch(cap, overhead)} for r, (m, cap) in enumerate(zip(models, caps))]
    limit = min(r["max_batch"] for r in per_rank)
    limiting = [r["rank"] for r in per_rank if r["max_batch"] == limit]
    out = {"parallel": parallel, "world": world, "projected": projected, "ranks": per_rank,
           "max_batch_per_rank": limit, "max_global_batch": limit * world, "limiting_ranks": limiting}
    return out | {"verdict": _verdict(out, caps)}


def _verdict(f: dict[str, Any], caps: list[int]) -> str:
    head = f"{f['parallel']} × {f['world']}{' (projected)' if f['projected'] else ''}"
    worst = f["ranks"][f["limiting_ranks"][0]]
    many = len(f["limiting_ranks"]) > 1
    who = f"rank{'s' * many} {', '.join(map(str, f['limiting_ranks']))} ({gib(worst['capacity_bytes'])})"
    verb = "" if many else "s"
    if f["max_batch_per_rank"] == 0:
        short = worst["fixed_bytes"] - worst["capacity_bytes"] * (1 - HEADROOM)
        fix = "shard with fsdp2, " if f["parallel"] == "ddp" else ""
        return (f"{head}: does not fit: {who} lack{verb} "
                f"{gib(max(short, 0))} even for a batch of 1; {fix}add ranks, or use larger devices")
    line = f"{head}: fits up to {f['max_batch_per_rank']} images per rank (global {f['max_global_batch']})"
    if len(set(caps)) > 1:
        best = max(r["max_batch"] for r in f["ranks"])
        line += f"; {who} limit{verb} the batch, the largest devices alone would take {best} per rank"
    return line


def recommend(fits: list[dict[str, Any]]) -> str:
    """For the most ranks that fit (the whole cluster where possible): each mode's largest batch."""
    ok = [f for f in fits if f["max_batch_per_rank"] > 0]
    if not ok:
        return "no measured or projected configuration fits these devices"
    world = max(f["world"] for f in ok)
    options = sorted((f for f in ok if f["world"] == world), key=lambda f: -f["max_global_batch"])
    line = f"on {world} rank(s): " + ", ".join(f"{f['parallel']} up to {f['max_batch_per_rank']} images per rank"
                                            for f in options)
    if len(options) > 1 and options[-1]["parallel"] == "ddp":  # both fit: DDP communicates less
        line += "; DDP is the simpler and faster choice when its batch is enough"
    return line

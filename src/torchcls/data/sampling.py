"""The order of an epoch, per rank, with a seed for every sample's augmentation.

Each position of an epoch's global order carries a key derived from (seed, epoch, position), and the
dataset seeds the transform's random draws with it. The augmentation of a sample therefore depends
on nothing a worker did before, which is what lets the map-style loader keep its workers alive
across epochs (persistent_workers) and resume mid-epoch by starting the order at the checkpointed
position instead of replaying, and so re-decoding, every batch already seen. It is also the same
whatever the number of ranks or workers.

Rank r of W takes positions r, r+W, r+2W, ... of the order, wrapped around at the end so that all
ranks run equally many steps (FSDP2 needs every rank in every all-gather): per-rank batches of B/W
make global batch k the same images as batch k of one process with batch B.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 100_003 + epoch  # also the in-memory loader's: both paths draw the same order


def sample_key(seed: int, epoch: int, position: int) -> int:
    """The seed of one sample's augmentation: a function of its place in the global order only."""
    return (epoch_seed(seed, epoch) * 1_000_003 + position) % (2**63 - 1)


def epoch_order(n: int, seed: int, epoch: int, weights: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Generator]:
    """The global order of an epoch, one for the map-style sampler and the in-memory loader: a
    permutation of the n samples, or with `weights` (--balanced-sampler) n draws with replacement,
    sample i with probability weights[i] / sum(weights). Also returns the generator, which the
    in-memory loader goes on drawing augmentation parameters from."""
    g = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    # The order a DataLoader with this generator drew before (it takes its workers' base seed first).
    torch.empty((), dtype=torch.int64).random_(generator=g)
    if weights is None:
        return torch.randperm(n, generator=g), g
    return torch.multinomial(weights, n, replacement=True, generator=g), g


def balanced_weights(targets: torch.Tensor, classes: list[str]) -> torch.Tensor:
    """--balanced-sampler: each training sample weighted by 1 / its class's count, so that every class is
    drawn equally often in expectation. `targets`: the class index of each training sample."""
    from torchcls.errors import UserError

    if targets.ndim != 1:
        raise UserError("--balanced-sampler weights one class per image; with --task multilabel it is not defined "
                        "(drop it, or use --class-weights none and a label-aware loss)")
    counts = torch.bincount(targets, minlength=len(classes))
    return 1.0 / counts[targets].double()


def padded_share(order: list[int], rank: int, world: int) -> list[int]:
    total = math.ceil(len(order) / world) * world
    return (order + order[: total - len(order)])[rank::world]


class EpochSampler(Sampler[tuple[int, int]]):
    """Yields (index, augmentation key) for one rank; `set_epoch(epoch, start)` before each pass."""

    def __init__(self, n: int, seed: int, shuffle: bool, rank: int = 0, world: int = 1):
        self.n, self.seed, self.shuffle, self.rank, self.world = n, seed, shuffle, rank, world
        self.epoch, self.start = 0, 0
        self.weights: torch.Tensor | None = None  # --balanced-sampler: draw with these weights (epoch_order)

    def __len__(self) -> int:
        return math.ceil(self.n / self.world)  # the whole share: a resumed pass is shorter, not the epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next pass serves `epoch` from this rank's position `start` on."""
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.shuffle:
            order = epoch_order(self.n, self.seed, self.epoch, self.weights)[0].tolist()
        else:
            order = list(range(self.n))
        share = padded_share(order, self.rank, self.world)
        start, self.start = self.start, 0
        for pos in range(start, len(share)):
            yield share[pos], sample_key(self.seed, self.epoch, pos * self.world + self.rank)

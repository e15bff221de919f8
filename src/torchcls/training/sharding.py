"""Data across ranks: each rank reads its share of every global batch, in a deterministic order.

The training order is exactly the single-process order: the sampler draws the same
permutation from the loader's generator that a shuffling DataLoader would (the loop re-seeds
that generator from (seed, epoch) each epoch), and rank r takes positions r, r+W, r+2W, ...
Per-rank batches of B/W then make global batch k the same set of images as batch k of a
one-process run with batch B, whatever the world size: a run resumed at another world size
continues the same data order. Validation (training/validation.py) shards the held-out images
the same way and leaves the wrap-around duplicates out.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from torchcls.data.loaders import collate_for, make_loader
from torchcls.training.distributed import Session


def _padded_share(order: list[int], rank: int, world: int) -> list[int]:
    # Pad by wrapping around (as DistributedSampler does) so that all ranks run equally many
    # steps: FSDP2 needs every rank in every all-gather.
    total = math.ceil(len(order) / world) * world
    order = order + order[: total - len(order)]
    return order[rank::world]


class ShardedShuffleSampler(Sampler[int]):
    def __init__(self, n: int, rank: int, world: int, generator: torch.Generator):
        self.n, self.rank, self.world, self.generator = n, rank, world, generator

    def __len__(self) -> int:
        return math.ceil(self.n / self.world)

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator).tolist()  # what RandomSampler draws
        return iter(_padded_share(order, self.rank, self.world))


class ShardedSequentialSampler(Sampler[int]):
    def __init__(self, n: int, rank: int, world: int):
        self.n, self.rank, self.world = n, rank, world

    def __len__(self) -> int:
        return math.ceil(self.n / self.world)

    def __iter__(self):
        return iter(_padded_share(list(range(self.n)), self.rank, self.world))


def per_rank_batch(batch_size: int, session: Session) -> int:
    return batch_size // session.world  # divisibility is checked at setup


def train_loader(ds: Dataset, batch_size: int, workers: int, seed: int, session: Session) -> DataLoader:
    if not session.active:
        return make_loader(ds, batch_size, workers, shuffle=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    return DataLoader(ds, batch_size=per_rank_batch(batch_size, session), num_workers=workers, generator=g,
                      sampler=ShardedShuffleSampler(len(ds), session.rank, session.world, g),
                      pin_memory=torch.cuda.is_available(), collate_fn=collate_for(ds))


def val_loader(ds: Dataset, batch_size: int, workers: int, session: Session) -> DataLoader:
    if not session.active:
        return make_loader(ds, batch_size, workers, shuffle=False)
    return DataLoader(ds, batch_size=batch_size, num_workers=workers,
                      sampler=ShardedSequentialSampler(len(ds), session.rank, session.world),
                      pin_memory=torch.cuda.is_available(), collate_fn=collate_for(ds))

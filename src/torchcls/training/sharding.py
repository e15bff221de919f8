"""Data across ranks: each rank reads its share of every global batch, in a deterministic order.

The training order is exactly the single-process order (torchcls.data.sampling.EpochSampler):
rank r takes positions r, r+W, r+2W, ... of the epoch's permutation, and every sample's
augmentation is seeded by its global position. Per-rank batches of B/W then make global batch k
the same images, augmented the same way, as batch k of a one-process run with batch B, whatever
the world size: a run resumed at another world size continues the same data order. Validation
(training/validation.py) shards the held-out images the same way and leaves the wrap-around
duplicates out.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset

from torchcls.data.loaders import make_loader
from torchcls.training.distributed import Session


def per_rank_batch(batch_size: int, session: Session) -> int:
    return batch_size // session.world  # divisibility is checked at setup


def train_loader(ds: Dataset, batch_size: int, workers: int, seed: int, session: Session) -> DataLoader:
    return make_loader(ds, per_rank_batch(batch_size, session), workers, shuffle=True, seed=seed,
                       rank=session.rank, world=session.world)


def val_loader(ds: Dataset, batch_size: int, workers: int, session: Session) -> DataLoader:
    return make_loader(ds, batch_size, workers, shuffle=False, rank=session.rank, world=session.world)

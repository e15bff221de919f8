"""What feeds the trainer: in-memory batches, streamed shards, or the map-style DataLoader.

All three yield this rank's (x, y) batches of the same global order and resume mid-epoch:
- memory: data that fits is decoded once into a uint8 cache and augmented a whole batch at a
  time (no workers); `seek` jumps to the checkpointed step without touching an image.
- shards: a StatefulDataLoader over WebDataset shards; its per-rank state is saved beside each
  checkpoint, so a resume decodes nothing twice.
- files: the DataLoader with persistent workers; every sample's augmentation is seeded by its
  place in the epoch's order (data/sampling.py), so a resume starts at the checkpointed position.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from typing_extensions import TypedDict

from torchcls.bounded_json import JsonBounds
from torchcls.checkpoint.files import atomic_write
from torchcls.config import Config
from torchcls.data.device_decode import decode_on_device, device_loader, why_not
from torchcls.data.inmemory import bundle_loaders
from torchcls.data.loaders import Transformed, build_transform, needed_side, reseed
from torchcls.data.sampling import balanced_weights, epoch_seed
from torchcls.data.shard_data import ShardBundle
from torchcls.errors import UserError
from torchcls.io_files import SMALL_JSON_BYTES
from torchcls.training import sharding
from torchcls.training.distributed import Session
from torchcls.training.rundir import read_checked

# checkpoints/loader.rank{N}.json of a shards run: the step and the loader's position, plus the
# (file, reason) pairs it skipped this epoch; compact JSON (>= 2 bytes a value), read back on --resume.
LOADER_STATE = JsonBounds(max_bytes=SMALL_JSON_BYTES, max_values=SMALL_JSON_BYTES // 2, max_depth=8, max_str=1 << 16)


class SavedLoader(TypedDict):  # loader.rank{N}.json; "loader" is checked by ShardLoader.load_state_dict
    step: int
    loader: dict[str, Any]


@dataclass
class Feed:
    kind: str  # "memory" | "shards" | "files"
    train: Any
    val: Any  # None: no validation set
    val_count: int  # distinct validation images (validation leaves the wrap-around padding out)
    seed: int
    skipped_at_cache: list[tuple[str, str]] = field(default_factory=list)
    _restored: bool = False
    val_streamed: bool | None = None  # None: as the training data (shards: streamed); False: map-style files

    def __len__(self) -> int:
        return len(self.train)

    def epoch(self, epoch: int, step_in_epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of `epoch` from `step_in_epoch` on."""
        if self.kind == "files":  # start at the step's position: each sample's augmentation has its own seed
            reseed(self.train, self.seed, epoch, start=step_in_epoch * self.train.batch_size)
            return iter(self.train)
        torch.manual_seed(epoch_seed(self.seed, epoch))  # dropout, drop-path: as reseed does for files
        if self.kind == "memory":
            self.train.set_epoch(epoch)
            self.train.seek(step_in_epoch)
            return iter(self.train)
        if not self._restored:  # shards: a restored loader state carries its own epoch and position
            self.train.set_epoch(epoch)
            if step_in_epoch:  # a checkpoint without its loader state (killed between the two writes): replay
                return _skip(iter(self.train), step_in_epoch)
        self._restored = False
        return iter(self.train)

    def val_own(self, rank: int, world: int) -> int:
        """How many of the validation images that `rank` reads are its own (see validation.validate)."""
        if self.kind == "shards" and self.val_streamed is not False:  # each rank streams a disjoint range
            from torchcls.data.streaming import rank_range

            lo, hi = rank_range(self.val_count, rank, world)
            return hi - lo
        return math.ceil((self.val_count - rank) / world)

    def decode_skips(self) -> list[list[str]]:
        return self.train.skipped + (getattr(self.val, "skipped", None) or []) if self.kind == "shards" else []

    # -- the streamed loader's position, saved beside the checkpoint of the same step
    def save_state(self, checkpoints: Path, rank: int, step: int, step_in_epoch: int) -> None:
        if self.kind != "shards":
            return
        if not step_in_epoch:  # an epoch boundary: set_epoch alone starts the next epoch exactly
            _state_file(checkpoints, rank).unlink(missing_ok=True)
            return
        state = json.dumps({"step": step, "loader": self.train.state_dict()})
        atomic_write(_state_file(checkpoints, rank), lambda tmp: Path(tmp).write_text(state))

    def load_state(self, checkpoints: Path, rank: int, step: int) -> None:
        path = _state_file(checkpoints, rank)
        if self.kind != "shards" or not path.is_file():
            return
        saved = read_checked(path, LOADER_STATE, SavedLoader, "loader state",
                             hint=f"delete {path} to resume without it, or start the run over")
        if saved["step"] == step:  # else the checkpoint is newer than the state: replay instead
            self.train.load_state_dict(saved["loader"], where=str(path))  # (its fields checked there, streaming.py)
            self._restored = True

    def release(self) -> None:
        """Let go of the loaders when the run ends, so their worker processes (persistent across epochs) stop
        now: a loader is held only here, and dropping it shuts its workers down. Otherwise they would live
        until a garbage collection found the trainer, and each would then hold that collection for up to 5 s."""
        self.train = self.val = None


def _state_file(checkpoints: Path, rank: int) -> Path:
    return checkpoints / f"loader.rank{rank}.json"


def _skip(batches: Iterator, n: int) -> Iterator:
    for _ in range(n):
        next(batches)
    return batches


def build_feed(cfg: Config, data, session: Session, device: torch.device) -> Feed:
    """The feed `data` (a DataBundle or ShardBundle) calls for under cfg.data (--in-memory, --workers)."""
    feed = _feed(cfg, data, session, device)  # (no loader has started a worker or read a file yet)
    if cfg.data.augment == "flip-alternate" and feed.kind != "memory":
        raise UserError("--augment flip-alternate mirrors each image by its index and the epoch, which only the "
                        "in-memory loader knows: use --in-memory auto or on (with a --memory-limit-mb the data "
                        "fits in, no --decode device), or --augment flip (random mirrors)")
    return feed


def _feed(cfg: Config, data, session: Session, device: torch.device) -> Feed:
    d, seed, rank, world = cfg.data, cfg.train.seed, session.rank, session.world
    if isinstance(data, ShardBundle):
        if d.balanced_sampler:
            raise UserError("--balanced-sampler needs every training label before the epoch starts; streamed "
                            "WebDataset shards are read in order. Train from the image folder or CSV, or drop it")
        return _shard_feed(cfg, data, session)
    if d.decode == "device" and d.in_memory == "on":
        raise UserError("--decode device decodes each batch's JPEGs where the model trains, --in-memory on decodes "
                        "them once into a cache: give one of them (--in-memory auto leaves the cache to --decode "
                        "device)")
    # An explicit --decode device is the per-sample path: the in-memory cache, which --in-memory auto would
    # pick for a folder that fits, would leave it unused without a word.
    memory = None if d.decode == "device" else bundle_loaders(data, d, seed, rank=rank, world=world, device=device,
                                                              val_batch_size=d.batch_size * 2)
    if memory is not None:
        train, val, bad = memory
        if d.balanced_sampler:
            train.weights = balanced_weights(train.targets[train.rows], data.classes)
        return Feed("memory", train, val if val.n else None, val.n, seed, bad)
    if decode_on_device(d.decode, data.train, device):  # --decode: JPEGs decoded where the model trains
        train, val = _device_decoded(cfg, data, session, device)
    else:
        train = sharding.train_loader(data.train, d.batch_size, d.workers, seed, session)
        val = sharding.val_loader(data.val, d.batch_size * 2, d.workers, session) if len(data.val) else None
    if d.balanced_sampler:
        train.sampler.weights = balanced_weights(data.train.images.targets[data.train.indices], data.classes)
    return Feed("files", train, val, len(data.val), seed)


def _device_decoded(cfg: Config, data, session: Session, device: torch.device):
    """The map-style loaders with batches decoded on `device` (data/device_decode.py): same order and draws."""
    from torchcls.console import console

    d, seed, rank, world = cfg.data, cfg.train.seed, session.rank, session.world
    train = device_loader(data.train, sharding.per_rank_batch(d.batch_size, session), d.workers, seed, True, rank,
                          world, device)
    val = None
    if len(data.val):
        val = device_loader(data.val, d.batch_size * 2, d.workers, seed, False, rank, world, device) \
            if why_not(data.val) is None else sharding.val_loader(data.val, d.batch_size * 2, d.workers, session)
    if session.is_main:
        console.print(f"decoding JPEGs on {device} (torchvision.io.decode_jpeg, one call per batch; crops, flips and "
                      "normalisation there too); --decode workers decodes them in the DataLoader workers")
    return train, val


def _shard_feed(cfg: Config, data: ShardBundle, session: Session) -> Feed:
    from torchcls.data.streaming import shard_loader

    d, pre, seed = cfg.data, data.preprocess, cfg.train.seed
    common = dict(rank=session.rank, world=session.world, on_bad_file=d.on_bad_file, channels=pre.channels,
                  max_pixels=d.max_pixels)
    batch = sharding.per_rank_batch(d.batch_size, session)
    transform = build_transform(pre, True, d.augment, data.train.side, random_erasing=d.random_erasing,
                                max_shift=d.max_shift)
    train = shard_loader(data.train, batch, d.workers, seed, transform=transform,
                         min_side=needed_side(pre, d.augment), **common)
    val, streamed = None, not isinstance(data.val, Transformed)  # --val-data of files: read map-style
    if data.val is not None and not streamed:
        val = sharding.val_loader(data.val, d.batch_size * 2, d.workers, session)
    elif data.val is not None:
        val = shard_loader(data.val, batch * 2, d.workers, seed, shuffle=False, min_side=pre.resize_size,
                           transform=build_transform(pre, False, source_size=data.val.side), **common)
    return Feed("shards", train, val, len(data.val) if data.val is not None else 0, seed, val_streamed=streamed)

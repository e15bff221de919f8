"""Batches straight from a uint8 image cache: no per-sample Python, no worker processes.

For data that fits in memory (the built-in sets, and any ImageSet decoded once at the
model's input size) a batch is one gather from a (N, C, S, S) uint8 tensor, then the
augmentation preset applied to the whole batch as tensor ops on the training device
(batch_augment.py), then one float conversion that also normalises. On 28x28 digits the
per-sample transforms.v2 pipeline in worker processes costs more than the model step;
here a batch of 128 costs about a millisecond on one core.

Order and randomness are those of the map-style path: the loader's own generator is
seeded from (seed, epoch) exactly as `loaders.reseed` seeds the DataLoader's, and the
permutation is drawn the way a shuffling DataLoader draws it, so with `augment="none"`
the batches are identical to the map-style loader's. Augmentation parameters are drawn
for the whole global batch on every rank, so rank r of W serves positions r, r+W, ...
(as training/sharding.py does) and global batch k is the same images, augmented the same
way, whatever the world size. `state_dict()` holds (epoch, batches served, generator
state), and `seek(k)` rebuilds that state from the epoch and k alone: a resumed loader
starts at the next batch without touching earlier ones.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torchvision.transforms import v2

from torchcls.data.batch_augment import (
    alternating_flips,
    flips_at,
    one_thread,
    resized_crop_boxes,
    resized_crop_flip,
    shift_flip,
)
from torchcls.data.images import BadImage
from torchcls.data.preprocess import Preprocess
from torchcls.data.refusals import refuse
from torchcls.data.sampling import epoch_order
from torchcls.data.sources import ImageSet
from torchcls.data.transforms import batch_augmentable, resize_and_crop, shift_pixels
from torchcls.errors import UserError

AUGMENTS = ("none", "light", "flip", "flip-alternate", "standard")
MODES = ("auto", "on", "off")


def cache_bytes(images: ImageSet, pre: Preprocess) -> int:
    """Bytes of the uint8 cache of `images` at the model's input size."""
    return len(images) * _cache_channels(images, pre) * pre.img_size ** 2


def use_in_memory(mode: str, limit_mb: float, images: ImageSet, pre: Preprocess) -> bool:
    """Whether to batch from a cache: auto = when it fits in `limit_mb`; on = always (refused if it does not fit)."""
    return _wanted(mode, limit_mb, cache_bytes(images, pre), images.name, pre)


def _wanted(mode: str, limit_mb: float, need_bytes: int, name: str, pre: Preprocess) -> bool:
    if mode not in MODES:
        raise UserError(f"--in-memory must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return False
    need_mb = need_bytes / 2 ** 20
    if need_mb <= limit_mb:
        return True
    if mode == "on":
        raise UserError(f"--in-memory on: {name} decoded at {pre.img_size} px needs {need_mb:,.0f} MB, more "
                        f"than --memory-limit-mb {limit_mb:g}. Raise the limit, lower --img-size, or use "
                        "--in-memory auto to fall back to the per-sample loader")
    return False


def _cache_channels(images: ImageSet, pre: Preprocess) -> int:
    # A grey built-in set shown as RGB is cached with one channel and expanded per batch.
    return 1 if images.images is not None else pre.channels


def train_side(images: ImageSet, pre: Preprocess, augment: str) -> int:
    """The side of the training cache: the images' own when they are all square and smaller than the input and
    the augmentation is a random-resized crop, which then crops the original as the map-style path does (a cache
    at the input size made it interpolate twice: 0.5 points of Fashion-MNIST top-1 at 32 px); else the input's."""
    size = pre.img_size
    if augment != "standard":
        return size
    if images.images is not None:
        h, w = images.images.shape[-2:]
        return int(h) if h == w and h < size else size
    if images.sizes is None or not len(images.sizes):
        return size
    side = int(images.sizes[0, 0])
    return side if side < size and bool((images.sizes == side).all()) else size


def build_cache(images: ImageSet, pre: Preprocess, threads: int = 0,
                side: int | None = None) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    """Decode every sample once, resized and centre-cropped to the input size (as the map-style eval transform),
    or kept as they are when `side` (train_side) is their own size.

    Returns the uint8 (N, C, S, S) cache and the (file, reason) of samples that failed to
    decode; their rows stay zero and `memory_loaders` leaves them out.
    """
    size = pre.img_size
    raw = side is not None and side != size
    if images.images is not None:  # built-in sets: already a uint8 (N, H, W) tensor
        cache = images.images.unsqueeze(1)
        if not raw and (cache.shape[-1] != size or cache.shape[-2] != size or pre.resize_size != size):
            cache = torch.cat([_fit(chunk, pre) for chunk in cache.split(4096)])
        return cache.contiguous(), []
    out = side if raw else size
    cache = torch.zeros(len(images), pre.channels, out, out, dtype=torch.uint8)
    fit = (lambda img: _fit(img, pre)) if not raw else (lambda img: v2.functional.resize(img, [out, out], antialias=True))

    def decode(i: int) -> tuple[str, str] | None:
        try:
            cache[i] = fit(images.load(i))  # raw: a file whose header lied about its size is resized to it
            return None
        except (BadImage, OSError, RuntimeError, ValueError) as e:  # the scan read headers only, or it changed
            return str(images.paths[i]), str(e)

    # Pillow releases the GIL while decoding, so threads decode in parallel.
    with ThreadPoolExecutor(max_workers=threads or min(8, (os.cpu_count() or 1) * 2)) as pool:
        bad = [r for r in pool.map(decode, range(len(images))) if r is not None]
    return cache, bad


def _fit(img: torch.Tensor, pre: Preprocess) -> torch.Tensor:
    return v2.Compose(resize_and_crop(pre))(img)


class InMemoryLoader:
    """A loader over rows of a uint8 cache: `for x, y in loader` gives float32 normalised x and int64 y.

    `batch_size` is the global batch; each of `world` ranks gets batch_size // world of it.
    `train=True` shuffles and augments; `train=False` keeps the order (padded by wrapping
    around so all ranks run equally many steps, like the sharded samplers).
    """

    def __init__(self, cache: torch.Tensor, targets: torch.Tensor, pre: Preprocess, batch_size: int, *,
                 train: bool, augment: str = "none", seed: int = 0, indices: torch.Tensor | None = None,
                 rank: int = 0, world: int = 1, device: torch.device | str = "cpu", max_shift: int | None = None):
        if augment not in AUGMENTS:
            raise UserError(f"--augment must be one of {', '.join(AUGMENTS)}, got {augment!r}")
        if batch_size < world or batch_size % world:
            raise UserError(f"--batch-size {batch_size} must be a multiple of the world size {world}")
        self.cache, self.targets, self.pre = cache, targets, pre
        self.rows = indices if indices is not None else torch.arange(len(cache))
        self.n = len(self.rows)  # distinct samples (validation masks the wrap-around padding with it)
        self.batch_size, self.train, self.augment, self.seed = batch_size, train, augment if train else "none", seed
        self.max_shift = shift_pixels(pre.img_size, max_shift)  # light/flip: RandomCrop's padding
        self.rank, self.world, self.device = rank, world, torch.device(device)
        mean, std = torch.tensor(pre.mean), torch.tensor(pre.std)
        # One fused multiply-add does ToDtype(scale=True) and Normalize: x/255 - mean over std.
        self._scale = (1 / (255 * std)).view(1, -1, 1, 1).to(self.device)
        self._bias = (-mean / std).view(1, -1, 1, 1).to(self.device)
        self._epoch, self._resume, self._live = 0, None, None
        self.weights: torch.Tensor | None = None  # --balanced-sampler: per-sample draw weights (epoch_order)
        self._base_flips = alternating_flips(self.n, seed) if self.augment == "flip-alternate" else None

    def __len__(self) -> int:
        return math.ceil(self._padded_n() / self.batch_size)

    def _padded_n(self) -> int:
        return math.ceil(self.n / self.world) * self.world

    def set_epoch(self, epoch: int) -> None:
        """Serve `epoch` from its start, unless a loaded state is mid-way through this same epoch."""
        if self._resume is not None and self._resume["epoch"] == epoch:
            return
        self._epoch, self._resume = epoch, None

    def state_dict(self) -> dict[str, Any]:
        if self._live is not None:  # mid-iteration: where the running epoch is
            epoch, position, gen = self._live
            return {"epoch": epoch, "position": position, "generator": gen.get_state() if gen else None,
                    "n": self.n, "batch_size": self.batch_size}
        if self._resume is not None:
            return dict(self._resume)
        return {"epoch": self._epoch, "position": 0, "generator": None, "n": self.n, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("n"), state.get("batch_size")) != (self.n, self.batch_size):
            raise UserError(f"the data loader state is for {state.get('n')} samples in global batches of "
                            f"{state.get('batch_size')}, but this run has {self.n} in batches of {self.batch_size}: "
                            "resume with the same data and --batch-size")
        self._epoch, self._resume, self._live = state["epoch"], dict(state), None

    def seek(self, position: int) -> None:
        """Make the next pass start the current epoch at batch `position`, producing none before it.

        Only the augmentation parameters of the skipped batches are drawn (no image is touched),
        which leaves the generator where `state_dict()` would have found it: a checkpoint that
        records (epoch, step in epoch) is enough to resume exactly."""
        if not 0 <= position <= len(self):  # (a resume checks the saved step first: Trainer.resume)
            raise UserError(f"the saved position, batch {position}, is outside this epoch's {len(self)} batches: "
                            "resume with the run's own data and --batch-size, or start over")
        _, gen = self._order(self._epoch)
        for k in range(position):
            self._draw(min(self.batch_size, self._padded_n() - k * self.batch_size), gen)
        self._resume = {"epoch": self._epoch, "position": position, "generator": gen.get_state() if gen else None,
                        "n": self.n, "batch_size": self.batch_size}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, resume = self._epoch, self._resume
        self._resume = None
        order, gen = self._order(epoch)
        start = 0
        if resume is not None and resume["position"]:
            start = resume["position"]
            if gen is not None:
                gen.set_state(resume["generator"])
        self._live = (epoch, start, gen)
        small = self.batch_size // self.world * self.pre.channels * self.pre.img_size ** 2 < 1 << 20
        try:
            for k in range(start, len(self)):
                positions = order[k * self.batch_size:(k + 1) * self.batch_size]
                with one_thread():
                    params = self._draw(len(positions), gen)  # for the global batch: same on every rank
                if self._base_flips is not None:  # flip-alternate: a function of (sample, epoch), not drawn
                    params["flip"] = flips_at(self._base_flips, positions, epoch)
                mine = slice(self.rank, None, self.world)
                rows = self.rows[positions[mine]]
                with one_thread() if small else contextlib.nullcontext():
                    x = self._augment(self.cache[rows].to(self.device, non_blocking=True),
                                      {key: v[mine] for key, v in params.items()})
                y = self.targets[rows].to(self.device, non_blocking=True)
                self._live = (epoch, k + 1, gen)
                yield x, y
            self._epoch = epoch + 1  # a completed pass moves on, so a plain `for epoch` loop reshuffles
        finally:
            self._live = None

    def _order(self, epoch: int) -> tuple[torch.Tensor, torch.Generator | None]:
        if not self.train:
            order = torch.arange(self.n)
            gen = None
        else:
            order, gen = epoch_order(self.n, self.seed, epoch, self.weights)  # the map-style path's order
        pad = self._padded_n() - self.n  # wrap around, as the sharded samplers do
        return torch.cat([order, order[:pad]]) if pad else order, gen

    def _draw(self, b: int, gen: torch.Generator | None) -> dict[str, torch.Tensor]:
        """Random parameters of one global batch, drawn on the CPU from the loader's generator."""
        p = self.max_shift
        if self.augment == "none":
            return {}
        if self.augment in ("light", "flip", "flip-alternate"):
            params = {"shift": torch.randint(0, 2 * p + 1, (b, 2), generator=gen)}
            if self.augment == "flip":
                params["flip"] = torch.rand(b, generator=gen) < 0.5
            return params
        # On the cache's side: the images' own when train_side kept it (the crop is then resized to the input)
        return {"box": resized_crop_boxes(b, self.cache.shape[-1], gen), "flip": torch.rand(b, generator=gen) < 0.5}

    def _augment(self, u8: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.pre.channels != u8.shape[1]:
            u8 = u8.expand(-1, self.pre.channels, -1, -1)
        if "shift" in params:
            flip = params.get("flip")
            u8 = shift_flip(u8, params["shift"].to(self.device), flip, self.max_shift)
        x = u8.float()
        if "box" in params:
            x = resized_crop_flip(x, params["box"].to(self.device), params["flip"].to(self.device), self.pre.img_size)
        return x.mul_(self._scale).add_(self._bias)


def memory_loaders(images: ImageSet, pre: Preprocess, train_idx: torch.Tensor, val_idx: torch.Tensor,
                   batch_size: int, augment: str, seed: int, *, max_shift: int | None = None,
                   on_bad_file: str = "error", val_images: ImageSet | None = None, val_batch_size: int | None = None,
                   rank: int = 0, world: int = 1, device: torch.device | str = "cpu",
                   ) -> tuple[InMemoryLoader, InMemoryLoader, list[tuple[str, str]]]:
    """The train and validation loaders (over one shared cache unless `val_images` is a separate set).

    Also returns the (file, reason) of the files that failed to decode; under
    on_bad_file="skip" they are left out of both loaders, under "error" they stop the run.
    """
    side = train_side(images, pre, augment)
    cache, train_idx, bad = _cache_rows(images, pre, train_idx, on_bad_file, side)
    # Validation needs the eval geometry: a second cache at the input size, of images no larger than it (so at
    # most twice the bytes --memory-limit-mb was checked against, for sets of small images).
    if (val_images is None or val_images is images) and side != pre.img_size:
        val_cache, val_idx, _ = _cache_rows(images, pre, _drop(val_idx, images, bad), on_bad_file)
    elif val_images is None or val_images is images:
        val_cache, val_idx = cache, _drop(val_idx, images, bad)
    else:
        val_cache, val_idx, val_bad = _cache_rows(val_images, pre, val_idx, on_bad_file)
        bad = bad + val_bad
    common = dict(seed=seed, rank=rank, world=world, device=device)
    train = InMemoryLoader(cache, images.targets, pre, batch_size, train=True, augment=augment,
                           max_shift=max_shift, indices=train_idx, **common)
    val = InMemoryLoader(val_cache, (val_images or images).targets, pre, val_batch_size or batch_size, train=False,
                         indices=val_idx, **common)
    return train, val, bad


def bundle_loaders(bundle: Any, cfg: Any, seed: int, *, rank: int = 0, world: int = 1,
                   device: torch.device | str = "cpu", val_batch_size: int | None = None,
                   ) -> tuple[InMemoryLoader, InMemoryLoader, list[tuple[str, str]]] | None:
    """In-memory loaders for a `build_data` DataBundle under DataConfig `cfg`, or None when --in-memory says no.

    None too for data that is not an indexable ImageSet (streamed shards)."""
    train_set, val_set = getattr(bundle.train, "images", None), getattr(bundle.val, "images", None)
    if not isinstance(train_set, ImageSet) or not isinstance(val_set, ImageSet):
        return None
    if not batch_augmentable(cfg.augment, cfg.random_erasing):  # per-sample library transforms: map-style path
        if cfg.in_memory == "on":
            raise UserError(f"--in-memory on batches with the presets {', '.join(AUGMENTS)} and no random erasing; "
                            f"--augment {cfg.augment} --random-erasing {cfg.random_erasing} runs per sample: "
                            "use --in-memory auto or off")
        return None
    sets = [train_set] if val_set is train_set else [train_set, val_set]
    need = sum(cache_bytes(s, bundle.preprocess) for s in sets)
    if not _wanted(cfg.in_memory, cfg.memory_limit_mb, need, " + ".join(s.name for s in sets), bundle.preprocess):
        return None
    return memory_loaders(train_set, bundle.preprocess, bundle.train.indices, bundle.val.indices, cfg.batch_size,
                          cfg.augment, seed, max_shift=cfg.max_shift, on_bad_file=cfg.on_bad_file, val_images=val_set,
                          val_batch_size=val_batch_size, rank=rank, world=world, device=device)


def _cache_rows(images: ImageSet, pre: Preprocess, idx: torch.Tensor, on_bad_file: str, side: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, str]]]:
    cache, bad = build_cache(images, pre, side=side)
    refuse(bad, on_bad_file, f"{images.origin or images.name} (failed to decode while caching it in memory)",
           nothing_left=len(bad) == len(images))
    return cache, _drop(idx, images, bad), bad


def _drop(idx: torch.Tensor, images: ImageSet, bad: list[tuple[str, str]]) -> torch.Tensor:
    if not bad:
        return idx
    bad_files = {f for f, _ in bad}
    good = torch.tensor([str(p) not in bad_files for p in images.paths])
    return idx[good[idx]]

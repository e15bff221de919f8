"""From a DataConfig to train/val splits, transforms.v2 pipelines and DataLoaders.

The validation set is, in this order: --val-data, the source's own val split (a val/
folder, CSV rows with split=val), or a seeded stratified --val-fraction of the training data.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from torchcls.config import DataConfig
from torchcls.data.images import BadImage
from torchcls.data.preprocess import Preprocess, PretrainedInput, resolve_preprocess
from torchcls.data.refusals import collect
from torchcls.data.sampling import EpochSampler, epoch_seed
from torchcls.data.skips import BadSampleError, DropBad, read_skips, record_skip, skip_log_path
from torchcls.data.sources import ImageSet, apply_size_limits, open_source
from torchcls.data.splits import available_splits, check_same_classes
from torchcls.data.transforms import build_transform
from torchcls.data.worker_start import worker_context
from torchcls.errors import UserError
from torchcls.run_files import write_text_atomic
from torchcls.tasks import check_task


class Transformed(Dataset):
    """A view of some indices of an ImageSet, with a transform.

    A file that fails to decode here (in a worker) follows --on-bad-file: 'error' raises
    BadSampleError naming it; 'skip' returns None (DropBad leaves it out of the batch) and
    appends it to `skip_log` (see skips.py), which the trainer reads back at the end."""

    def __init__(self, images: ImageSet, indices: torch.Tensor, transform: v2.Transform,
                 on_bad_file: str = "error", sample_shape: tuple[int, ...] | None = None):
        self.images, self.indices, self.transform = images, indices, transform
        self.on_bad_file, self.sample_shape = on_bad_file, sample_shape
        self.skip_log: Path | None = None
        self.decode_skipped: list[tuple[str, str]] = []  # this process only (workers=0)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int] | None:
        """Sample `item`: an index, or (index, key) from an EpochSampler, whose key seeds the augmentation."""
        i, key = item if isinstance(item, tuple) else (item, None)
        if key is not None:  # the CPU generator only: torch.manual_seed would also seed every GPU, per sample
            torch.default_generator.manual_seed(key)
        j = int(self.indices[i])
        try:
            img = self.images.load(j)
        except BadImage as e:
            name = self.images.paths[j] if self.images.paths is not None else f"{self.images.name}[{j}]"
            return self._bad(str(name), str(e))
        target = self.images.targets[j]  # multi-label: a float (classes,) row, collated to (B, classes)
        return self.transform(img), (target if target.ndim else int(target))

    def _bad(self, file: str, reason: str) -> None:
        if self.on_bad_file == "error":
            raise BadSampleError(f"{file}: {reason} (found while decoding; fix or remove the file, "
                                 "or pass --on-bad-file skip to leave it out)")
        self.decode_skipped.append((file, reason))
        if self.skip_log is not None:
            record_skip(self.skip_log, file, reason)
        else:
            warnings.warn(f"skipped {file}: {reason}", stacklevel=2)
        return None


def stratified_split(targets: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded split keeping each class's share in both parts; the same seed always gives the same split."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if targets.ndim == 2:  # multi-label: stratify by the set of labels each image has
        targets = torch.unique(targets, dim=0, return_inverse=True)[1]
    g = torch.Generator().manual_seed(seed)
    train_idx, val_idx = [], []
    for c in torch.unique(targets):
        idx = torch.nonzero(targets == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_val = int(round(len(idx) * val_fraction))
        val_idx.append(idx[:n_val])
        train_idx.append(idx[n_val:])
    return torch.cat(train_idx).sort().values, torch.cat(val_idx).sort().values


@dataclass
class DataBundle:
    images: ImageSet  # the training data
    preprocess: Preprocess
    train: Transformed
    val: Transformed
    val_images: ImageSet | None = None  # a separate validation set; None: held out of `images`
    splits: dict[str, Any] = field(default_factory=dict)  # which split came from where (data_splits.json)
    preprocess_from: dict[str, str] = field(default_factory=dict)  # which source set each part (preprocess.json)

    @property
    def classes(self) -> list[str]:
        return self.images.classes

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """Files left out when the sources were opened (decode-time skips: see `read_skips`)."""
        return self.images.skipped + (self.val_images.skipped if self.val_images is not None else [])

    def log_skips_to(self, run_dir: str | Path, rank: int = 0) -> None:
        """Make decode-time skips of this rank (and its workers) go to a file in `run_dir`."""
        self.train.skip_log = self.val.skip_log = skip_log_path(run_dir, rank)

    def write_skipped_files(self, run_dir: str | Path) -> int:
        """Write skipped_files.json: files left out at the scan, then at decode time by any rank or
        worker (read back from the per-rank logs). Returns how many; writes nothing when none."""
        entries = [{"file": f, "reason": r, "stage": "scan"} for f, r in self.skipped]
        decoded = read_skips(run_dir)
        if self.train.skip_log is None:  # no log attached: this process's own (workers=0) skips
            decoded += [{"file": f, "reason": r, "times": 1}
                        for f, r in self.train.decode_skipped + self.val.decode_skipped]
        entries += [{**d, "stage": "decode"} for d in decoded]
        if entries:
            write_text_atomic(Path(run_dir) / "skipped_files.json", json.dumps({"skipped_files": entries}, indent=2))
        return len(entries)

    def write_splits(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / "data_splits.json"
        write_text_atomic(path, json.dumps(self.splits, indent=2))  # a link in a received run dir is replaced
        return path


def needed_side(pre: Preprocess, augment: str) -> int:
    """The shortest image side the transforms use at full resolution: big JPEGs decode down to it.

    Random resized crops keep down to ~half of the short side, so they need twice the size; the
    others resize the short side to `resize_size` before their centre crop."""
    return pre.img_size * 2 if augment == "standard" else pre.resize_size


def _check_max_pixels(cfg: DataConfig, pre: Preprocess) -> None:
    if cfg.max_pixels < 0 or 0 < cfg.max_pixels < pre.img_size ** 2:
        raise UserError(f"--max-pixels {cfg.max_pixels}: below the model's input of {pre.img_size}x{pre.img_size} "
                        f"= {pre.img_size ** 2} pixels; use a larger value, or 0 for no limit")


def _open(cfg: DataConfig, source: str, split: str, channels: int | None, min_side: int | None = None) -> ImageSet:
    images = open_source(source, cfg.root, split, channels, cfg.on_bad_file, cfg.max_pixels, cfg.image_column,
                         cfg.label_column)
    return apply_size_limits(images, min_side, cfg.on_bad_file) if min_side else images


def _separate_val(cfg: DataConfig, channels: int, min_side: int) -> tuple[ImageSet | None, str]:
    """The validation set given on its own (--val-data, or the source's val split), and how it was found."""
    if cfg.val_data:
        split = "val" if "val" in available_splits(cfg.val_data) else "all"
        return _open(cfg, cfg.val_data, split, channels, min_side), "--val-data"
    if "val" in available_splits(cfg.source):
        return _open(cfg, cfg.source, "val", channels, min_side), "the source's val split"
    return None, f"held out: --val-fraction {cfg.val_fraction} of the training data, stratified, seeded"


@collect()  # every unreadable file of the train and validation sets in one refusal
def build_data(cfg: DataConfig, seed: int, pretrained: PretrainedInput | None = None) -> DataBundle:
    """`pretrained`: the input a pretrained backbone expects (see data/preprocess.py)."""
    images = _open(cfg, cfg.source, "train", cfg.channels)
    check_task(cfg.task, images.targets, images.origin or cfg.source)
    _check_classes(images)
    pre, chosen = resolve_preprocess(cfg, images, pretrained)
    _check_max_pixels(cfg, pre)
    need = needed_side(pre, cfg.augment)
    images = apply_size_limits(images, need, cfg.on_bad_file)  # before the split: evaluate repeats it
    val_images, how = _separate_val(cfg, pre.channels, need)
    if val_images is None:
        val_set, (train_idx, val_idx) = images, stratified_split(images.targets, cfg.val_fraction, seed)
    else:
        check_same_classes(images.classes, val_images.classes, val_images.origin, images.origin)
        check_task(cfg.task, val_images.targets, val_images.origin)
        val_set, train_idx, val_idx = val_images, torch.arange(len(images)), torch.arange(len(val_images))
    size, shape = images.side, (pre.channels, pre.img_size, pre.img_size)
    augment = build_transform(pre, True, cfg.augment, size, cfg.random_erasing, cfg.max_shift)
    train = Transformed(images, train_idx, augment, cfg.on_bad_file, shape)
    val = Transformed(val_set, val_idx, build_transform(pre, False, source_size=val_set.side), cfg.on_bad_file,
                      shape)
    splits = {"train": {"source": images.origin, "images": len(train_idx)},
              "val": {"source": val_set.origin, "images": len(val_idx), "how": how}}
    if "test" in available_splits(cfg.source):
        splits["test"] = {"source": f"{cfg.source} (test split; used by evaluate --split test)"}
    return DataBundle(images, pre, train, val, val_images, splits, chosen)


@collect()
def eval_dataset(cfg: DataConfig, pre: Preprocess, split: str, seed: int) -> tuple[Transformed, ImageSet]:
    """The data an evaluation runs on: a test or validation set of its own, a seeded held-out part, or all.

    `cfg` is the training run's: the held-out part is the very one training left out."""
    need = needed_side(pre, cfg.augment)  # as in build_data, so the seeded split matches training's
    val_images, _ = _separate_val(cfg, pre.channels, need) if split in ("val", "train") else (None, "")
    if split in ("test", "all"):
        if split == "test" and "test" not in available_splits(cfg.source):
            raise UserError(f"{cfg.source} has no test split (no test/ folder, no CSV rows with split=test); "
                            "evaluate with --split val")
        images = _open(cfg, cfg.source, split, pre.channels, need)
        idx = torch.arange(len(images))
    elif val_images is not None:  # train and val are separate sets: each is used whole
        images = val_images if split == "val" else _open(cfg, cfg.source, "train", pre.channels, need)
        idx = torch.arange(len(images))
    else:
        images = _open(cfg, cfg.source, "train", pre.channels, need)
        train_idx, val_idx = stratified_split(images.targets, cfg.val_fraction, seed)
        idx = val_idx if split == "val" else train_idx
    if len(idx) == 0:
        raise UserError(f"the '{split}' split of {cfg.source} is empty (val fraction {cfg.val_fraction})")
    return Transformed(images, idx, build_transform(pre, False, source_size=images.side), cfg.on_bad_file,
                       (pre.channels, pre.img_size, pre.img_size)), images


def _check_classes(images: ImageSet) -> None:
    if len(images.classes) < 2:
        raise UserError(f"{images.name}: found {len(images.classes)} class(es); classification needs at least 2")
    multilabel = images.targets.ndim == 2
    counts = images.targets.sum(0) if multilabel else torch.bincount(images.targets, minlength=len(images.classes))
    empty = [images.classes[i] for i in range(len(images.classes)) if counts[i] == 0]
    if empty:
        raise UserError(f"{images.name}: class(es) with no usable images: {', '.join(empty)}")


def collate_for(ds: Dataset) -> DropBad:
    """The collate_fn every DataLoader over a `Transformed` needs: it drops skipped bad files."""
    return DropBad(getattr(ds, "sample_shape", None))


def make_loader(ds: Dataset, batch_size: int, workers: int, shuffle: bool, seed: int = 0, rank: int = 0,
                world: int = 1) -> DataLoader:
    """A loader over `ds` whose order, and every sample's augmentation, are functions of (seed, epoch,
    position) (see sampling.py): workers persist across epochs, and `reseed(loader, seed, epoch, start)`
    makes the next pass serve `epoch` from this rank's position `start` on, with nothing replayed."""
    return DataLoader(ds, batch_size=batch_size, sampler=EpochSampler(len(ds), seed, shuffle, rank, world),
                      num_workers=workers, persistent_workers=workers > 0, drop_last=False,
                      collate_fn=collate_for(ds), pin_memory=torch.cuda.is_available(),
                      multiprocessing_context=worker_context(workers))


def reseed(loader: DataLoader, seed: int, epoch: int, start: int = 0) -> None:
    """Make the next pass of `loader` serve `epoch` from position `start`, and seed the main process's
    RNG (dropout, drop-path) from (seed, epoch)."""
    loader.sampler.set_epoch(epoch, start)
    torch.manual_seed(epoch_seed(seed, epoch))

"""From a DataConfig to seeded train/val splits, transforms.v2 pipelines and DataLoaders."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from torchcls.config import DataConfig
from torchcls.data.sources import IMAGENET_STATS, STATS, ImageSet, open_source
from torchcls.errors import UserError


@dataclass(frozen=True)
class Preprocess:
    """What an image needs before the model: travels inside checkpoints and exported artifacts."""

    img_size: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def preprocess_for(cfg: DataConfig, images: ImageSet) -> Preprocess:
    channels = cfg.channels or images.channels
    if channels not in (1, 3):
        raise UserError(f"--channels must be 1 or 3, got {channels}")
    size = cfg.img_size or images.side or 224
    mean, std = STATS.get(images.name, IMAGENET_STATS if channels == 3 else ((0.5,), (0.5,)))
    if len(mean) != channels:  # grey set shown as RGB or photos as grey: one value per channel
        mean, std = (sum(mean) / len(mean),) * channels, (sum(std) / len(std),) * channels
    return Preprocess(size, channels, tuple(mean), tuple(std))


def build_transform(pre: Preprocess, train: bool, augment: str = "none", source_size: int | None = None) -> v2.Transform:
    """uint8 CxHxW tensor → normalised float tensor of shape (channels, img_size, img_size).

    `source_size`: the side of every input when known to be square and fixed (built-in
    sets); resizing is then skipped when it would be a no-op (it costs more than the
    rest of the pipeline on 28x28 digits).
    """
    size = pre.img_size
    steps: list[v2.Transform] = []
    if train and augment == "standard":
        steps += [v2.RandomResizedCrop(size, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    else:
        if source_size != size:
            steps += [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        if train and augment in ("light", "flip"):
            # Small translations: safe for digits and text, where flips and big crops are not.
            steps.append(v2.RandomCrop(size, padding=max(1, size // 8)))
        if train and augment == "flip":  # for left-right symmetric classes (clothes, objects)
            steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(pre.mean, pre.std)]
    return v2.Compose(steps)


class Transformed(Dataset):
    """A view of some indices of an ImageSet, with a transform."""

    def __init__(self, images: ImageSet, indices: torch.Tensor, transform: v2.Transform):
        self.images, self.indices, self.transform = images, indices, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        j = int(self.indices[i])
        return self.transform(self.images.load(j)), int(self.images.targets[j])


def stratified_split(targets: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded split keeping each class's share in both parts; the same seed always gives the same split."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
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
    images: ImageSet
    preprocess: Preprocess
    train: Transformed
    val: Transformed

    @property
    def classes(self) -> list[str]:
        return self.images.classes


def build_data(cfg: DataConfig, seed: int) -> DataBundle:
    images = open_source(cfg.source, cfg.root, "train", cfg.channels, cfg.on_bad_file)
    _check_classes(images)
    pre = preprocess_for(cfg, images)
    train_idx, val_idx = stratified_split(images.targets, cfg.val_fraction, seed)
    size = images.side
    return DataBundle(images, pre, Transformed(images, train_idx, build_transform(pre, True, cfg.augment, size)),
                      Transformed(images, val_idx, build_transform(pre, False, source_size=size)))


def eval_dataset(cfg: DataConfig, pre: Preprocess, split: str, seed: int) -> tuple[Transformed, ImageSet]:
    """The data an evaluation runs on: the official test split, the seeded held-out split, or all of it."""
    images = open_source(cfg.source, cfg.root, "test" if split == "test" else "train", pre.channels,
                         cfg.on_bad_file)
    if split == "test":
        idx = torch.arange(len(images))
    else:
        train_idx, val_idx = stratified_split(images.targets, cfg.val_fraction, seed)
        idx = {"val": val_idx, "train": train_idx, "all": torch.arange(len(images))}[split]
    if len(idx) == 0:
        raise UserError(f"the '{split}' split of {cfg.source} is empty (val fraction {cfg.val_fraction})")
    return Transformed(images, idx, build_transform(pre, False, source_size=images.side)), images


def _check_classes(images: ImageSet) -> None:
    if len(images.classes) < 2:
        raise UserError(f"{images.name}: found {len(images.classes)} class(es); classification needs at least 2")
    counts = torch.bincount(images.targets, minlength=len(images.classes))
    empty = [images.classes[i] for i in range(len(images.classes)) if counts[i] == 0]
    if empty:
        raise UserError(f"{images.name}: class(es) with no usable images: {', '.join(empty)}")


def make_loader(ds: Dataset, batch_size: int, workers: int, shuffle: bool, seed: int = 0) -> DataLoader:
    # The generator drives both the shuffle order and the workers' seeds; re-seeding it
    # each epoch (see `reseed`) makes every epoch reproducible on its own, which is what
    # exact resume needs. Workers are not persistent for the same reason.
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                      generator=torch.Generator().manual_seed(seed), drop_last=False,
                      pin_memory=torch.cuda.is_available())


def reseed(loader: DataLoader, seed: int, epoch: int) -> None:
    """Make the next iteration of `loader` (order, worker RNG, main-process RNG) a function of (seed, epoch)."""
    loader.generator.manual_seed(seed * 100_003 + epoch)
    torch.manual_seed(seed * 100_003 + epoch)  # used by transforms when workers == 0, and by dropout

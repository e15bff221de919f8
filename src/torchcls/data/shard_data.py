"""A data set of WebDataset shards as the trainer sees one: classes, preprocessing, train and
validation shard sets, and where each split came from - the streamed counterpart of DataBundle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from torchcls.config import DataConfig
from torchcls.data.loaders import Transformed, needed_side
from torchcls.data.preprocess import Preprocess, PretrainedInput, resolve_preprocess
from torchcls.data.shards import ShardSet, is_shard_source, open_shards, split_shards
from torchcls.data.skips import read_skips, skip_log_path
from torchcls.data.sources import apply_size_limits, open_source
from torchcls.data.splits import available_splits, check_same_classes
from torchcls.data.transforms import build_transform
from torchcls.run_files import write_text_atomic


@dataclass
class ShardBundle:
    images: ShardSet  # every training shard (governance reads it like an ImageSet's files)
    preprocess: Preprocess
    train: ShardSet
    val: ShardSet | Transformed | None  # streamed shards, or a folder / CSV / built-in set read map-style
    splits: dict[str, Any] = field(default_factory=dict)
    preprocess_from: dict[str, str] = field(default_factory=dict)  # which source set each part (preprocess.json)

    @property
    def classes(self) -> list[str]:
        return self.images.classes

    @property
    def skipped(self) -> list[tuple[str, str]]:
        return list(self.images.skipped)

    def log_skips_to(self, run_dir: str | Path, rank: int = 0) -> None:
        """Bad samples inside shards are counted by the streaming loader itself (see write_skipped_files); a
        validation set of files logs its own, as a DataBundle's does."""
        if isinstance(self.val, Transformed):
            self.val.skip_log = skip_log_path(run_dir, rank)

    def write_skipped_files(self, run_dir: str | Path, decode_skips: list[list[str]] = ()) -> int:
        """skipped_files.json: samples left out when the shards were written, and [shard, key, reason]
        of those the loaders left out at decode time."""
        entries = [{"file": f, "reason": r, "stage": "shard"} for f, r in self.skipped]
        entries += [{"file": f"{shard}#{key}", "reason": reason, "stage": "decode"}
                    for shard, key, reason in decode_skips]
        if isinstance(self.val, Transformed):
            entries += [{"file": f"{d['file']}", "reason": d["reason"], "stage": "decode"} for d in read_skips(run_dir)]
        if entries:
            write_text_atomic(Path(run_dir) / "skipped_files.json", json.dumps({"skipped_files": entries}, indent=2))
        return len(entries)

    def write_splits(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / "data_splits.json"
        write_text_atomic(path, json.dumps(self.splits, indent=2))  # a link in a received run dir is replaced
        return path


def build_shard_data(cfg: DataConfig, seed: int, pretrained: PretrainedInput | None = None) -> ShardBundle:
    """Open `cfg.source` (a shard folder or brace pattern) and its validation part: --val-data (shards, or
    any other source: a folder, a CSV, a built-in set), else whole seeded shards held out per
    --val-fraction. `pretrained`: as in build_data."""
    shards = open_shards(cfg.source)
    # Normalisation statistics follow what the shards were written from (mnist-5k, a folder...).
    like = SimpleNamespace(name=shards.source or shards.name, channels=shards.channels, side=shards.side)
    pre, chosen = resolve_preprocess(cfg, like, pretrained)
    if cfg.val_data is not None:
        train, how = shards, "--val-data"
        val = open_shards(cfg.val_data) if is_shard_source(cfg.val_data) else _file_val(cfg, pre)
        check_same_classes(train.classes, val.images.classes if isinstance(val, Transformed) else val.classes,
                           cfg.val_data, cfg.source)
    else:
        train, val = split_shards(shards, cfg.val_fraction, seed)
        how = f"whole shards held out (--val-fraction {cfg.val_fraction}, seed {seed})"
    splits = {"train": {"source": cfg.source, "images": len(train), "shards": len(train.shards)},
              "val": {"source": cfg.val_data or cfg.source, "images": len(val) if val else 0, "how": how}}
    return ShardBundle(shards, pre, train, val, splits, chosen)


def _file_val(cfg: DataConfig, pre: Preprocess) -> Transformed:
    """A validation set that is not shards: its val split (a folder with train/ val/ test/, a CSV with a split
    column) or all of it, decoded per sample as the trainer's map-style feed does, with the shards' preprocessing."""
    split = "val" if "val" in available_splits(cfg.val_data) else "all"
    images = open_source(cfg.val_data, cfg.root, split, pre.channels, cfg.on_bad_file, cfg.max_pixels,
                         cfg.image_column, cfg.label_column)
    images = apply_size_limits(images, needed_side(pre, "none"), cfg.on_bad_file)
    return Transformed(images, torch.arange(len(images)), build_transform(pre, False, source_size=images.side),
                       cfg.on_bad_file, (pre.channels, pre.img_size, pre.img_size))

"""A data set of WebDataset shards as the trainer sees one: classes, preprocessing, train and
validation shard sets, and where each split came from - the streamed counterpart of DataBundle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torchcls.config import DataConfig
from torchcls.data.preprocess import Preprocess, PretrainedInput, resolve_preprocess
from torchcls.data.shards import ShardSet, is_shard_source, open_shards, split_shards
from torchcls.data.splits import check_same_classes
from torchcls.errors import UserError


@dataclass
class ShardBundle:
    images: ShardSet  # every training shard (governance reads it like an ImageSet's files)
    preprocess: Preprocess
    train: ShardSet
    val: ShardSet | None
    splits: dict[str, Any] = field(default_factory=dict)
    preprocess_from: dict[str, str] = field(default_factory=dict)  # which source set each part (preprocess.json)

    @property
    def classes(self) -> list[str]:
        return self.images.classes

    @property
    def skipped(self) -> list[tuple[str, str]]:
        return list(self.images.skipped)

    def log_skips_to(self, run_dir: str | Path, rank: int = 0) -> None:
        """Bad samples inside shards are counted by the streaming loader itself (see write_skipped_files)."""

    def write_skipped_files(self, run_dir: str | Path, decode_skips: list[list[str]] = ()) -> int:
        """skipped_files.json: samples left out when the shards were written, and [shard, key, reason]
        of those the loaders left out at decode time."""
        entries = [{"file": f, "reason": r, "stage": "shard"} for f, r in self.skipped]
        entries += [{"file": f"{shard}#{key}", "reason": reason, "stage": "decode"}
                    for shard, key, reason in decode_skips]
        if entries:
            (Path(run_dir) / "skipped_files.json").write_text(json.dumps({"skipped_files": entries}, indent=2))
        return len(entries)

    def write_splits(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / "data_splits.json"
        path.write_text(json.dumps(self.splits, indent=2))
        return path


def build_shard_data(cfg: DataConfig, seed: int, pretrained: PretrainedInput | None = None) -> ShardBundle:
    """Open `cfg.source` (a shard folder or brace pattern) and its validation part: --val-data shards,
    else whole seeded shards held out per --val-fraction. `pretrained`: as in build_data."""
    shards = open_shards(cfg.source)
    if cfg.val_data is not None:
        if not is_shard_source(cfg.val_data):
            raise UserError(f"--val-data {cfg.val_data}: training reads shards, so the validation set must be shards "
                            "too (write it with `torchcls data shard SOURCE --split val --out DIR`)")
        train, val = shards, open_shards(cfg.val_data)
        check_same_classes(train.classes, val.classes, cfg.val_data, cfg.source)
        how = "--val-data"
    else:
        train, val = split_shards(shards, cfg.val_fraction, seed)
        how = f"whole shards held out (--val-fraction {cfg.val_fraction}, seed {seed})"
    # Normalisation statistics follow what the shards were written from (mnist-5k, a folder...).
    like = SimpleNamespace(name=shards.source or shards.name, channels=shards.channels, side=shards.side)
    pre, chosen = resolve_preprocess(cfg, like, pretrained)
    splits = {"train": {"source": cfg.source, "images": len(train), "shards": len(train.shards)},
              "val": {"source": cfg.val_data or cfg.source, "images": len(val) if val else 0, "how": how}}
    return ShardBundle(shards, pre, train, val, splits, chosen)

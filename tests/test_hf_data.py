"""Local Hugging Face data sets (--data hf:PATH): save_to_disk folders and Parquet files, read offline."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from torchcls.data.hf import hf_data_files, hf_splits
from torchcls.data.sources import open_source
from torchcls.errors import UserError

datasets = pytest.importorskip("datasets")


def pictures(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (6 + i % 3, 7, 3), dtype=np.uint8) for i in range(n)]


def make_dataset(n: int = 9, names=("cat", "dog", "owl")):
    from PIL import Image
    features = datasets.Features({"img": datasets.Image(), "y": datasets.ClassLabel(names=list(names))})
    return datasets.Dataset.from_dict(
        {"img": [Image.fromarray(a) for a in pictures(n)], "y": [i % len(names) for i in range(n)]},
        features=features)


def test_save_to_disk_round_trip(tmp_path: Path):
    make_dataset().save_to_disk(str(tmp_path / "ds"))
    images = open_source(f"hf:{tmp_path / 'ds'}", None, "train", None, "error", image_column="img",
                         label_column="y")
    assert images.classes == ["cat", "dog", "owl"]  # from the ClassLabel feature
    assert images.targets.tolist() == [i % 3 for i in range(9)] and len(images) == 9
    for i, want in enumerate(pictures(9)):
        assert torch.equal(images.load(i), torch.from_numpy(want).permute(2, 0, 1))  # PNG: lossless
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
    copy = pickle.loads(pickle.dumps(images))  # what a DataLoader worker receives: reopens the table
    assert torch.equal(copy.load(4), images.load(4))
    assert images.load(2).shape[0] == 3 and open_source(f"hf:{tmp_path / 'ds'}", None, "train", 1, "error",
                                                        image_column="img", label_column="y").load(2).shape[0] == 1


def test_dataset_dict_splits(tmp_path: Path):
    datasets.DatasetDict({"train": make_dataset(9), "validation": make_dataset(6), "test": make_dataset(3)}) \
        .save_to_disk(str(tmp_path / "dd"))
    source = f"hf:{tmp_path / 'dd'}"
    assert hf_splits(source) == {"train", "val", "test"}
    sizes = {split: len(open_source(source, None, split, None, "error", image_column="img", label_column="y"))
             for split in ("train", "val", "test")}
    assert sizes == {"train": 9, "val": 6, "test": 3}
    files = hf_data_files(source, "test")  # what governance hashes: the Arrow data and its description
    assert {f.name for f in files} >= {"data-00000-of-00001.arrow", "dataset_info.json"}
    assert all(f.parent.name == "test" and f.is_file() for f in files)


def test_parquet_files_with_string_labels(tmp_path: Path):
    ds = make_dataset(8)
    ds = ds.map(lambda row: {"name": ["zebra", "ant"][row["y"] % 2]})
    (tmp_path / "pq").mkdir()
    ds.select(range(5)).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    ds.select(range(5, 8)).to_parquet(str(tmp_path / "pq" / "part-1.parquet"))
    images = open_source(f"hf:{tmp_path / 'pq'}", None, "train", None, "error", image_column="img",
                         label_column="name")
    assert images.classes == ["ant", "zebra"] and len(images) == 8
    assert images.targets.tolist() == [1 if i % 3 % 2 == 0 else 0 for i in range(8)]
    assert torch.equal(images.load(6), torch.from_numpy(pictures(8)[6]).permute(2, 0, 1))
    single = open_source(f"hf:{tmp_path / 'pq' / 'part-1.parquet'}", None, "train", None, "error",
                         image_column="img", label_column="y")
    assert single.classes == ["cat", "dog", "owl"] and len(single) == 3  # ClassLabel names kept in Parquet metadata


def test_missing_columns_name_the_columns_found(tmp_path: Path):
    make_dataset().save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(UserError, match="no column 'image', 'label'; the columns are img, y.*--image-column"):
        open_source(f"hf:{tmp_path / 'ds'}", None, "train", None, "error")
    with pytest.raises(UserError, match="does not exist"):
        open_source(f"hf:{tmp_path / 'nothing'}", None, "train", None, "error")
    with pytest.raises(UserError, match="no separate test split"):
        open_source(f"hf:{tmp_path / 'ds'}", None, "test", None, "error", image_column="img", label_column="y")


def test_hf_set_becomes_shards_with_its_stored_bytes(tmp_path: Path):
    from torchcls.data.shards import write_shards
    from torchcls.data.streaming import shard_loader
    make_dataset().save_to_disk(str(tmp_path / "ds"))
    images = open_source(f"hf:{tmp_path / 'ds'}", None, "train", None, "error", image_column="img", label_column="y")
    shardset = write_shards(images, tmp_path / "shards", shuffle=False)
    assert shardset.classes == ["cat", "dog", "owl"] and len(shardset) == 9
    batches = list(shard_loader(shardset, 1, 0, seed=0, shuffle=False))  # images of several sizes
    assert [int(b[1]) for b in batches] == images.targets.tolist()
    assert all(torch.equal(b[0][0], images.load(i)) for i, b in enumerate(batches))

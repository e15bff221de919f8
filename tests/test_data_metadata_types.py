"""Values a data set's metadata files declare (a shard set's index.json, Hugging Face features) and size strings,
typed and ranged before they are used: a wrong one is a UserError naming the file or option, never a ValueError,
AttributeError or OverflowError deep inside a command, and a shard name never reaches outside its folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from torchcls.config import DataConfig
from torchcls.data import hf_saved
from torchcls.data.shard_data import build_shard_data
from torchcls.data.shards import INDEX, open_shards, parse_size, write_shards
from torchcls.data.sources import ImageSet, open_source
from torchcls.errors import UserError
from torchcls.suite import memory_fit
from torchcls.training.class_weights import class_weights

WRONG = ([], {}, 1, "x", True, None)  # each field of a valid file replaced in turn with each of these


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    """A real shard set of 2 classes in 3 shards, as `torchcls data shard` writes it."""
    images = torch.zeros(30, 8, 8, dtype=torch.uint8)
    images[:, 0, 0] = torch.arange(30, dtype=torch.uint8)  # different bytes, so different PNGs
    write_shards(ImageSet("tiny", ["a", "b"], torch.arange(30) % 2, 1, images=images), tmp_path / "shards",
                 shard_size_bytes=30_000, max_count=10)
    return tmp_path / "shards"


def rewrite(folder: Path, change) -> Path:
    index_path = folder / INDEX
    index = json.loads(index_path.read_text())
    change(index)
    index_path.write_text(json.dumps(index))
    return index_path


def use(folder: Path) -> torch.Tensor | None:
    """What training reads of a shard set: the bundle (preprocessing sized by channels and image_size), and
    --class-weights auto's weights (sized by class_counts); every shard a file of the folder itself."""
    bundle = build_shard_data(DataConfig(source=str(folder), val_fraction=0.0), seed=0)
    assert all(s.path.parent == folder for s in bundle.train.shards) and len(bundle.train) == 30
    weights = class_weights(bundle)
    assert weights is None or weights.shape == (len(bundle.classes),)
    return weights


def test_a_written_index_is_accepted_and_weighs_its_classes(shard_dir: Path):
    assert len(open_shards(str(shard_dir)).shards) == 3
    assert use(shard_dir).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("counts", [["x", "y"], [[1], [2, 3]], [5], [15, 15, 0], [-5, 35], [15, 16], [30.0, 0]])
def test_class_counts_of_another_type_or_length_are_refused_when_opened(shard_dir: Path, counts):
    # review 5, finding 5: ["x","y"] and [[1],[2,3]] were a ValueError in --class-weights auto; [5] for 2 classes a
    # 1-element weight that failed cross_entropy mid-training. Counts must be one per class, summing to the samples.
    index_path = rewrite(shard_dir, lambda index: index.update(class_counts=counts))
    with pytest.raises(UserError, match=str(index_path)):
        use(shard_dir)


@pytest.mark.parametrize("name", ["../outside.tar", "/ABS", "sub/train-000000.tar", "..", ".", "train\\x.tar", ""])
def test_a_shard_name_must_be_a_plain_tar_name_in_the_index_folder(shard_dir: Path, name: str):
    # review 5, finding 5: names were joined unchecked, so "../x.tar" or an absolute path named any file of the
    # recorded size. Here the file outside exists with that size: the old code opened it.
    first = shard_dir / "train-000000.tar"
    outside = shard_dir.parent / "outside.tar"
    shutil.copy(first, outside)
    name = str(outside) if name == "/ABS" else name
    index_path = rewrite(shard_dir, lambda index: index["shards"][0].update(name=name))
    with pytest.raises(UserError, match=str(index_path)):
        open_shards(str(shard_dir))


@pytest.mark.parametrize(("field", "value"), [("samples", "5"), ("samples", 10**12), ("samples", 0), ("bytes", "9"),
                                              ("bytes", -1), ("bytes", 2**41), ("samples", 10.0)])
def test_shard_counts_are_ints_in_range(shard_dir: Path, field: str, value):
    # `samples` went through int(): "5" and 10**12 were accepted, and sized len(loader) and the schedule.
    index_path = rewrite(shard_dir, lambda index: index["shards"][0].update({field: value}))
    with pytest.raises(UserError, match=str(index_path)):
        open_shards(str(shard_dir))


@pytest.mark.parametrize(("field", "value"), [("channels", 0), ("channels", 65), ("channels", 10**9),
                                              ("channels", "3"), ("image_size", 0), ("image_size", 10**6)])
def test_channels_and_image_size_are_ranged(shard_dir: Path, field: str, value):
    index_path = rewrite(shard_dir, lambda index: index.update({field: value}))
    with pytest.raises(UserError, match=str(index_path)):
        use(shard_dir)


def index_fields(folder: Path) -> list[tuple[str, ...]]:
    index = json.loads((folder / INDEX).read_text())
    return [(k,) for k in index] + [("shards", k) for k in index["shards"][0]]


def test_every_field_of_the_index_of_a_wrong_type_is_a_user_error_naming_the_file(shard_dir: Path, tmp_path: Path):
    pristine = tmp_path / "pristine"
    shutil.copytree(shard_dir, pristine)
    for field in index_fields(shard_dir):
        for value in WRONG:
            shutil.rmtree(shard_dir)
            shutil.copytree(pristine, shard_dir)

            def change(index, field=field, value=value):
                (index if len(field) == 1 else index["shards"][0])[field[-1]] = value

            index_path = rewrite(shard_dir, change)
            try:
                use(shard_dir)  # a value of the right type (channels 1, image_size null...) is used as it is
            except UserError as e:
                assert str(index_path) in str(e), (field, value, e)


def test_shard_and_memory_sizes_of_310_digits_are_refused_naming_the_option():
    # review 5, finding 8: int(float("1" + "0"*310)) was an OverflowError, not a message.
    huge = "1" + "0" * 320 + "GB"
    with pytest.raises(UserError, match="--shard-size"):
        parse_size(huge)
    with pytest.raises(UserError, match="--device-memory"):
        memory_fit.parse_size(huge, "--device-memory")


@pytest.mark.parametrize("text", ["2TiB", "0", "0.0000000000000000000001GB", "1" * 19, "1.5e3MB", "-1GB"])
def test_shard_sizes_out_of_range_are_refused(text: str):
    with pytest.raises(UserError, match="--shard-size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["2000TiB", "1" * 19 + "t", "9" * 18 + ".5t", "1" * 40])
def test_memory_sizes_out_of_range_are_refused(text: str):
    with pytest.raises(UserError, match="--overhead"):
        memory_fit.parse_size(text, "--overhead")


def test_sizes_in_range_are_read_as_before():
    assert parse_size("1GB") == 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1TiB") == 2**40
    assert memory_fit.parse_size("80GiB", "x") == 80 * 2**30 and memory_fit.parse_size(".5g", "x") == 2**29


def test_a_size_is_checked_as_the_whole_bytes_it_returns_and_read_exactly():
    # review 7, F5: '0.9' passed "above 0" as a float and returned 0 bytes; 18 digits went through float() and came
    # back rounded (123456789012345678 -> ...680).
    for text in ("0.9", "0.4b", ".000001k"):
        with pytest.raises(UserError, match=rf"--shard-size '{text}' is 0 bytes: give a size from 1 byte up to 1TiB"):
            parse_size(text)
    assert memory_fit.parse_size("123456789012345", "x") == 123456789012345
    assert memory_fit.parse_size("999999999999.999999k", "x") == 1023999999999999  # exact: float() gave ...000
    assert parse_size("1.5 g") == 3 * 2**29 and parse_size("2\tkb") == 2000
    with pytest.raises(UserError, match="cannot read it as a size"):
        parse_size("\xa01GB")  # a Unicode space is no separator here


# ---------------------------------------------------------------- Hugging Face features

def saved_dataset(tmp_path: Path) -> Path:
    datasets = pytest.importorskip("datasets")
    from PIL import Image
    features = datasets.Features({"img": datasets.Image(), "y": datasets.ClassLabel(names=["cat", "dog", "owl"])})
    rows = {"img": [Image.new("RGB", (5, 4), (i, 0, 0)) for i in range(6)], "y": [i % 3 for i in range(6)]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    return tmp_path / "ds"


def open_hf(folder: Path) -> ImageSet:
    return open_source(f"hf:{folder}", None, "train", None, "error", image_column="img", label_column="y")


def rewrite_info(folder: Path, change) -> Path:
    info_path = folder / hf_saved.INFO
    info = json.loads(info_path.read_text())
    change(info)
    info_path.write_text(json.dumps(info))
    return info_path


def test_a_label_feature_of_another_type_is_refused_naming_the_file(tmp_path: Path):
    # review 5, finding 6: {"features": {"label": 5}} was AttributeError: 'int' object has no attribute 'get'.
    folder = saved_dataset(tmp_path)
    assert open_hf(folder).classes == ["cat", "dog", "owl"]
    info_path = rewrite_info(folder, lambda info: info["features"].update(y=5))
    with pytest.raises(UserError, match=rf"{info_path}: features\.y"):
        open_hf(folder)


def test_every_feature_field_of_a_wrong_type_is_a_user_error_naming_the_data(tmp_path: Path):
    folder = saved_dataset(tmp_path)
    pristine = json.loads((folder / hf_saved.INFO).read_text())
    places = [lambda info: info, lambda info: info["features"], lambda info: info["features"]["y"]]
    keys = ["features", "y", "_type", "names"]
    for where, key in zip(places + [places[2]], keys):
        for value in WRONG:
            (folder / hf_saved.INFO).write_text(json.dumps(pristine))

            def change(info, where=where, key=key, value=value):
                where(info)[key] = value

            rewrite_info(folder, change)
            try:
                open_hf(folder)  # ("features": null or {}, "_type": "x": integer labels named 0, 1, 2)
            except UserError as e:
                assert str(folder) in str(e), (key, value, e)


def test_a_parquet_label_feature_of_another_type_is_refused(tmp_path: Path):
    # The same entry where `to_parquet` keeps it: the file's 'huggingface' metadata.
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.table({"img": pa.array([{"bytes": b"x", "path": None}]), "y": pa.array([0])})
    for meta in ({"info": {"features": {"y": 5}}}, {"info": []}, {"info": {"features": "x"}}, [1]):
        path = tmp_path / "one.parquet"
        pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps(meta)}), path)
        with pytest.raises(UserError, match="Parquet 'huggingface' metadata"):
            open_source(f"hf:{path}", None, "train", None, "error", image_column="img", label_column="y")

"""Local Hugging Face data sets (`--data hf:PATH`): a `save_to_disk` folder or Parquet file(s).

Nothing is downloaded, and `datasets` is not called: torchcls reads the files with pyarrow itself (a saved
folder through hf_saved.py, which bounds its JSON and opens only the plain file names it gives). The Arrow
table is memory-mapped and each image is decoded only when a sample is loaded, so opening a million-row
set costs the labels column alone. Class names come from the label column's ClassLabel feature when it has
one, else from the sorted string labels, else '0', '1', ...; their count is bounded (label_bounds.py)
before a name is made for each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from typing_extensions import NotRequired, TypedDict

from torchcls.bounded_json import load_bounded
from torchcls.data import hf_saved
from torchcls.data import images as image_files
from torchcls.data.label_bounds import check_class_count, check_class_names, check_label_index
from torchcls.errors import UserError
from torchcls.io_files import regular_path
from torchcls.typed_json import check

PREFIX = "hf:"
# Our split names -> the names a DatasetDict may use for them.
_SPLIT_ALIASES = {"val": ("val", "validation", "valid"), "train": ("train",), "test": ("test",)}


def is_hf_source(source: str) -> bool:
    return source.startswith(PREFIX)


@dataclass
class HFImageSet:
    """ImageSet-compatible view of an Arrow table: name, classes, targets, channels, images, paths, skipped."""

    name: str
    classes: list[str]
    targets: torch.Tensor
    channels: int
    location: tuple[str, str, str | None]  # (kind, path, split) to reopen the table in another process
    image_column: str
    images: None = None
    paths: None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    has_test_split: bool = False
    sizes: None = None
    origin: str = ""
    max_pixels: int = image_files.MAX_PIXELS
    min_side: int | None = None  # set by the loader, as for ImageSet: big JPEGs decode reduced
    _column: Any = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def side(self) -> int | None:
        return None

    def __getstate__(self) -> dict:
        # Workers reopen the memory-mapped table instead of receiving a pickled copy of the data.
        return {**self.__dict__, "_column": None}

    def load(self, i: int) -> torch.Tensor:
        if self._column is None:
            self._column = _open_table(*self.location).column(self.image_column)
        try:
            data = _image_bytes(_cell(self._column, i, self.image_column), self.image_column)
            return image_files.decode_bytes(data, self.channels, self.min_side, self.max_pixels)
        except image_files.BadImage as e:
            raise image_files.BadImage(f"{self.name} row {i}: {e}") from None

    def encoded(self, i: int) -> tuple[bytes, str]:
        """Row i's image as stored (no re-encode) and its format's extension, for write_shards."""
        if self._column is None:
            self._column = _open_table(*self.location).column(self.image_column)
        try:
            data = _image_bytes(_cell(self._column, i, self.image_column), self.image_column)
            fmt = image_files.probe_bytes(data).format.lower()  # from the bytes, never Pillow
        except image_files.BadImage as e:
            raise image_files.BadImage(f"{self.name} row {i}: {e}") from None
        return data, {"jpeg": "jpg"}.get(fmt, fmt)


# A cell is measured in the Arrow array before anything copies it: `column[i]` (a Scalar) already copies a binary
# cell, and a 600 MiB cell (a sparse Arrow file: free on disk) was copied whole before the per-image bound refused
# it. Beside the image's bytes a cell may hold its path (HF's Image struct) and Arrow's offsets and validity.
MAX_CELL_EXTRA = 64 << 10


def _cell(column: Any, i: int, name: str) -> Any:
    """Row i of the image column as a Python value (bytes, a path, or HF's Image struct of both), copied out of the
    memory-mapped table only once the bytes it references are counted (from the array's offsets, no copy) and
    found within image_formats.Bounds.max_file_bytes; BadImage otherwise."""
    cell = next((c for c in column.slice(i, 1).chunks if len(c)), None)  # a view of row i (zero-copy)
    if cell is None:
        raise IndexError(f"row {i} of a {len(column)}-row column")
    size, limit = _referenced_bytes(cell), image_files.BOUNDS.max_file_bytes
    if size > limit + MAX_CELL_EXTRA:
        raise image_files.BadImage(f"too large to read: column '{name}' holds {size:,} bytes here, and an image is "
                                   f"read whole to be decoded, at most {limit:,} bytes "
                                   "(image_formats.Bounds.max_file_bytes)")
    return cell[0].as_py()


def _referenced_bytes(cell: Any) -> int:
    """The bytes a one-row array references: Array.nbytes (which follows offsets: a binary or large_binary cell
    counts its own bytes), except that a view type's would count every data buffer its chunk shares, so its length
    is read from its 16-byte view (the Arrow format: an int32 length first)."""
    import pyarrow.types as pat
    kind = cell.type
    if pat.is_struct(kind):
        return sum(_referenced_bytes(child) for child in cell.flatten())  # (flatten follows the slice's offset)
    if pat.is_binary_view(kind) or pat.is_string_view(kind):
        if not cell.is_valid()[0].as_py():
            return 0
        view = cell.buffers()[1]
        return int.from_bytes(view[16 * cell.offset:16 * cell.offset + 4].to_pybytes(), "little", signed=True)
    return cell.nbytes


def _image_bytes(value: Any, column: str) -> bytes:
    """A cell of the image column -> encoded image bytes (HF Image struct, raw bytes or a file path)."""
    if isinstance(value, dict):  # the datasets Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:  # a path in a table cell: read as every image file is (regular, bounded)
        try:
            return image_files.read_image_file(value)
        except image_files.BadImage as e:
            raise image_files.BadImage(f"image file {value} named in column '{column}': {e}") from None
    raise image_files.BadImage(f"column '{column}' holds no image here ({type(value).__name__})")


def _open_table(kind: str, path: str, split: str | None):
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # never reach for the Hub, whatever the folder says
    if kind == "parquet":
        import pyarrow as pa
        budget = [MAX_PARQUET_DECODED]
        tables = [_read_parquet(f, budget) for f in _parquet_files(Path(path))]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    return _load_from_disk(Path(path), split).table


# Parquet is decoded whole into memory when opened (an Arrow save_to_disk folder is memory-mapped instead):
# what its footer declares decoded is bounded first. A 13.5 KB file holding one 400 MB zstd cell of zeros
# cost 1.3 GB at open. Images are stored compressed already, so real data decodes to about its own size.
MAX_PARQUET_DECODED = 16 << 30  # all the Parquet files of a set together
PARQUET_RATIO, PARQUET_FLOOR = 100, 256 << 20  # and each to at most max(100 x its bytes, 256 MiB)


def _read_parquet(path: Path, budget: list[int]):
    import pyarrow as pa
    import pyarrow.parquet as pq
    with regular_path(path, what="Parquet file") as checked:  # the mapping outlives the descriptor
        try:
            meta = pq.ParquetFile(checked).metadata
            declared = sum(meta.row_group(g).column(c).total_uncompressed_size
                           for g in range(meta.num_row_groups) for c in range(meta.num_columns))
            limit = min(budget[0], max(PARQUET_RATIO * os.path.getsize(checked), PARQUET_FLOOR))
            if declared > limit:
                raise UserError(f"{path}: its columns decode to {declared:,} bytes, more than {limit:,} (a Parquet "
                                f"set is held decoded in memory: at most {MAX_PARQUET_DECODED:,} bytes in all, each "
                                f"file at most {PARQUET_RATIO}x its size); save it with save_to_disk (memory-mapped)")
            budget[0] -= declared
            return pq.read_table(checked, memory_map=True)
        except (pa.ArrowInvalid, OSError) as e:
            raise UserError(f"{path}: not a readable Parquet file ({e})") from None


def _parquet_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise UserError(f"hf:{path}: no .parquet files in this folder")
    return files


def _load_from_disk(path: Path, split: str | None) -> hf_saved.SavedSplit:
    """`split` of the save_to_disk folder `path` (a Dataset, or a DatasetDict of split folders), read by
    hf_saved under its bounds: `datasets.load_from_disk` would open whatever the folder's JSON names."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    names = hf_saved.split_names(path)
    if names is not None:
        chosen = [n for n in _SPLIT_ALIASES.get(split, (split,)) if n in names]
        if not chosen:
            raise UserError(f"hf:{path} has the splits {', '.join(names)}; it has no '{split}' split")
        return hf_saved.read_split(path / chosen[0])
    if split not in (None, "train", "all"):
        raise UserError(f"hf:{path} is a single data set with no separate {split} split; "
                        "evaluate with --split val (the seeded held-out part)")
    return hf_saved.read_split(path)


def hf_splits(path: str) -> set[str]:
    """The splits (train, val, test) a save_to_disk DatasetDict folder holds; {'train'} for anything else."""
    path = path[len(PREFIX):] if is_hf_source(path) else path
    names = hf_saved.split_names(Path(path))
    if names is None:
        return {"train"}
    return {ours for ours, theirs in _SPLIT_ALIASES.items() if set(names) & set(theirs)}


class ParquetMeta(TypedDict):
    """A Parquet file's 'huggingface' metadata, as far as torchcls reads it."""

    info: NotRequired[hf_saved.Info]


# The label column's feature entry, typed before its ClassLabel names are read (`{"label": 5}` was an
# AttributeError). A functional TypedDict: pydantic leaves a class's `_type` field out as private.
LabelFeature = TypedDict("LabelFeature", {"_type": NotRequired[str], "names": NotRequired[list[str]]})


def _features_file(kind: str, path: Path) -> str:
    """Where the feature descriptions of `path` are read from, as messages name it."""
    return f"hf:{path}: its Parquet 'huggingface' metadata" if kind == "parquet" else str(path / hf_saved.INFO)


def _hf_features(kind: str, path: Path, table: Any) -> dict:
    """The `datasets` feature descriptions (ClassLabel names live there), if the files carry them."""
    if kind != "parquet":
        return hf_saved.features(path)
    meta = (table.schema.metadata or {}).get(b"huggingface")
    where = _features_file(kind, path)
    value = check(load_bounded(meta, hf_saved.INFO_BOUNDS, where), ParquetMeta, where, cause=hf_saved.NOT_HF) \
        if meta else {}
    return value.get("info", {}).get("features") or {}


def _labels(table: Any, column: str, feature: Any, name: str, described: str) -> tuple[list[str], torch.Tensor]:
    """Class names and one class index per row; the class count is bounded before a name is made for each.
    `feature`: the column's entry of the features `described` (a file) holds, typed here when it is read."""
    import pyarrow.types as pat
    col, where = table.column(column), f"{name}: column '{column}'"
    if col.null_count:
        raise UserError(f"{where} has {col.null_count:,} empty (null) labels; every row needs one")
    if pat.is_integer(col.type):  # (only an integer column's entry is read: another's may be a list)
        check(feature, LabelFeature, f"{described}: features.{column}", cause=hf_saved.NOT_HF)
        return _integer_labels(col, feature, where)
    if pat.is_string(col.type) or pat.is_large_string(col.type):
        return _string_labels(col, where)
    raise UserError(f"{name}: label column '{column}' has type {col.type}; use integer or string labels "
                    "(or name another column with --label-column)")


def _integer_labels(col: Any, feature: dict, where: str) -> tuple[list[str], torch.Tensor]:
    values = col.to_numpy()
    low, top = (int(values.min()), int(values.max())) if len(values) else (0, -1)
    if low < 0:
        raise UserError(f"{where} has negative labels ({low}); classes must be 0, 1, ...")
    names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
    if names is None:
        check_label_index(top, where)  # before '0'..str(top) are made
        return [str(c) for c in range(top + 1)], torch.from_numpy(values.astype("int64"))
    check_class_count(len(names), where, "ClassLabel names")
    check_class_names(names, where)
    if top >= len(names):
        raise UserError(f"{where}: label {top} but the ClassLabel has {len(names)} names")
    return list(names), torch.from_numpy(values.astype("int64"))


def _string_labels(col: Any, where: str) -> tuple[list[str], torch.Tensor]:
    import pyarrow as pa
    import pyarrow.compute as pc
    distinct = pc.unique(col)  # Arrow memory, no more than the column holds
    check_class_count(len(distinct), where, "distinct labels")
    classes = sorted(distinct.to_pylist())
    check_class_names(classes, where)
    index = pc.index_in(col, value_set=pa.array(classes, type=col.type))
    return classes, torch.from_numpy(index.to_numpy().astype("int64"))


def open_hf(path: str, split: str = "train", channels: int | None = None, image_column: str = "image",
            label_column: str = "label", max_pixels: int = image_files.MAX_PIXELS) -> HFImageSet:
    """Open `hf:PATH` (the prefix is optional here) for `split`; images decode lazily by row."""
    path = path[len(PREFIX):] if is_hf_source(path) else path
    root, name = Path(path), f"{PREFIX}{path}"
    if not root.exists():
        raise UserError(f"--data {name}: {root} does not exist (a save_to_disk folder or .parquet file(s))")
    kind = "parquet" if root.suffix == ".parquet" or (root.is_dir() and any(root.glob("*.parquet"))) else "disk"
    has_test = False
    if kind == "disk":
        saved = _load_from_disk(root, split)
        table, folder = saved.table, saved.folder
        has_test = "test" in hf_splits(path)
    else:
        if split not in ("train", "all"):
            raise UserError(f"{name}: Parquet files have no separate {split} split; evaluate with --split val")
        table, folder = _open_table(kind, path, None), root
    found = table.column_names
    missing = [c for c in (image_column, label_column) if c not in found]
    if missing:
        raise UserError(f"{name}: no column {', '.join(repr(c) for c in missing)}; the columns are "
                        f"{', '.join(found)}. Name the right ones with --image-column and --label-column")
    feature = _hf_features(kind, folder, table).get(label_column, {})
    classes, targets = _labels(table, label_column, feature, name, _features_file(kind, folder))
    return HFImageSet(name, classes, targets, channels or 3, (kind, path, split if kind == "disk" else None),
                      image_column, has_test_split=has_test, origin=f"{name} {split}", max_pixels=max_pixels)


def hf_data_files(source: str, split: str = "train") -> list[Path]:
    """The files that hold `hf:PATH`'s data (Arrow or Parquet, plus the feature description), for
    governance to hash and cite: the samples themselves are rows, not files."""
    path = Path(source[len(PREFIX):] if is_hf_source(source) else source)
    if path.suffix == ".parquet" or (path.is_dir() and any(path.glob("*.parquet"))):
        return _parquet_files(path)
    saved = _load_from_disk(path, split)
    return saved.files + [p for p in (saved.folder / hf_saved.INFO, saved.folder / hf_saved.STATE) if p.is_file()]

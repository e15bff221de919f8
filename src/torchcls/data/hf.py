"""Local Hugging Face data sets (`--data hf:PATH`): a `save_to_disk` folder or Parquet file(s).

Nothing is downloaded (HF_DATASETS_OFFLINE=1 before `datasets` is imported). The Arrow table is
memory-mapped and each image is decoded only when a sample is loaded, so opening a million-row
set costs the labels column alone. Class names come from the label column's ClassLabel feature
when it has one, else from the sorted string labels, else '0', '1', ...
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchcls.data import images as image_files
from torchcls.errors import UserError
from torchcls.extras import missing_extra
from torchcls.io_files import check_regular, read_bytes, regular_path

PREFIX = "hf:"
MAX_JSON_BYTES = 64 << 20  # dataset_dict.json, dataset_info.json: features and split names, parsed whole
MAX_IMAGE_FILE_BYTES = 256 << 20  # an image file a row names by path (what its decoder then bounds in pixels)
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
        value = self._column[i].as_py()
        try:
            data = _image_bytes(value, self.image_column)
            return image_files.decode_bytes(data, self.channels, self.min_side, self.max_pixels)
        except image_files.BadImage as e:
            raise image_files.BadImage(f"{self.name} row {i}: {e}") from None

    def encoded(self, i: int) -> tuple[bytes, str]:
        """Row i's image as stored (no re-encode) and its format's extension, for write_shards."""
        if self._column is None:
            self._column = _open_table(*self.location).column(self.image_column)
        try:
            data = _image_bytes(self._column[i].as_py(), self.image_column)
            fmt = image_files.probe_bytes(data).format.lower()  # from the bytes, never Pillow
        except image_files.BadImage as e:
            raise image_files.BadImage(f"{self.name} row {i}: {e}") from None
        return data, {"jpeg": "jpg"}.get(fmt, fmt)


def _image_bytes(value: Any, column: str) -> bytes:
    """A cell of the image column -> encoded image bytes (HF Image struct, raw bytes or a file path)."""
    if isinstance(value, dict):  # the datasets Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        try:  # a path in a table cell: opened only as a regular file, read under a bound
            return read_bytes(value, max_bytes=MAX_IMAGE_FILE_BYTES, what="image file")
        except UserError as e:
            raise image_files.BadImage(f"image file {value} named in column '{column}': {e}") from None
        except OSError as e:
            raise image_files.BadImage(f"image file {value} named in column '{column}' is unreadable: {e}") from None
    raise image_files.BadImage(f"column '{column}' holds no image here ({type(value).__name__})")


def _open_table(kind: str, path: str, split: str | None):
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # never reach for the Hub, whatever the folder says
    if kind == "parquet":
        import pyarrow.parquet as pq
        tables = []
        for f in _parquet_files(Path(path)):
            with regular_path(f, what="Parquet file") as checked:  # the mapping outlives the descriptor
                tables.append(pq.read_table(checked, memory_map=True))
        if len(tables) == 1:
            return tables[0]
        import pyarrow as pa
        return pa.concat_tables(tables)
    ds = _load_from_disk(Path(path), split)
    return ds.data.table


def _parquet_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise UserError(f"hf:{path}: no .parquet files in this folder")
    return files


def _check_saved_files(path: Path) -> None:
    """Refuse a save_to_disk folder whose Arrow or JSON files (at its top or in a split's folder) are not
    regular files, before `datasets` opens them: a FIFO would block it. (Checked, then opened by `datasets`:
    a file swapped in between by whoever can write the folder is not caught; docs/security.md.)"""
    for p in [*path.glob("*"), *path.glob("*/*")]:
        if p.suffix in (".arrow", ".json"):
            check_regular(p, what="saved data set file")


def _load_from_disk(path: Path, split: str | None):
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ModuleNotFoundError:
        raise missing_extra("hf", "--data hf:...", "datasets") from None
    _check_saved_files(path)
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"hf:{path}: not a Hugging Face save_to_disk folder ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = [n for n in _SPLIT_ALIASES.get(split, (split,)) if n in ds]
        if not names:
            raise UserError(f"hf:{path} has the splits {', '.join(ds)}; it has no '{split}' split")
        ds = ds[names[0]]
    elif split not in (None, "train", "all"):
        raise UserError(f"hf:{path} is a single data set with no separate {split} split; "
                        "evaluate with --split val (the seeded held-out part)")
    return ds.flatten_indices() if ds._indices is not None else ds


def hf_splits(path: str) -> set[str]:
    """The splits (train, val, test) a save_to_disk DatasetDict folder holds; {'train'} for anything else."""
    path = path[len(PREFIX):] if is_hf_source(path) else path
    listing = Path(path) / "dataset_dict.json"
    if not listing.exists():
        return {"train"}
    names = set(json.loads(read_bytes(listing, max_bytes=MAX_JSON_BYTES, what="dataset_dict.json")).get("splits", []))
    return {ours for ours, theirs in _SPLIT_ALIASES.items() if names & set(theirs)}


def _hf_features(kind: str, path: Path, table: Any) -> dict:
    """The `datasets` feature descriptions (ClassLabel names live there), if the files carry them."""
    if kind == "parquet":
        meta = (table.schema.metadata or {}).get(b"huggingface")
        return json.loads(meta).get("info", {}).get("features", {}) if meta else {}
    info = path / "dataset_info.json"
    if not info.exists():
        return {}
    return json.loads(read_bytes(info, max_bytes=MAX_JSON_BYTES, what="dataset_info.json")).get("features", {})


def _labels(table: Any, column: str, feature: dict, name: str) -> tuple[list[str], torch.Tensor]:
    import pyarrow.types as pat
    col = table.column(column)
    if pat.is_integer(col.type):
        values = col.to_numpy()
        if (values < 0).any():
            raise UserError(f"{name}: column '{column}' has negative labels; classes must be 0, 1, ...")
        names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
        top = int(values.max()) if len(values) else -1
        classes = list(names) if names else [str(c) for c in range(top + 1)]
        if top >= len(classes):
            raise UserError(f"{name}: label {top} in column '{column}' but the ClassLabel has {len(classes)} names")
        return classes, torch.from_numpy(values.astype("int64"))
    if pat.is_string(col.type) or pat.is_large_string(col.type):
        values = col.to_pylist()
        classes = sorted(set(values))
        index = {c: i for i, c in enumerate(classes)}
        return classes, torch.tensor([index[v] for v in values], dtype=torch.int64)
    raise UserError(f"{name}: label column '{column}' has type {col.type}; use integer or string labels "
                    "(or name another column with --label-column)")


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
        ds = _load_from_disk(root, split)
        table, folder = ds.data.table, Path(ds.cache_files[0]["filename"]).parent if ds.cache_files else root
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
    features = _hf_features(kind, folder, table)
    classes, targets = _labels(table, label_column, features.get(label_column, {}), name)
    return HFImageSet(name, classes, targets, channels or 3, (kind, path, split if kind == "disk" else None),
                      image_column, has_test_split=has_test, origin=f"{name} {split}", max_pixels=max_pixels)


def hf_data_files(source: str, split: str = "train") -> list[Path]:
    """The files that hold `hf:PATH`'s data (Arrow or Parquet, plus the feature description), for
    governance to hash and cite: the samples themselves are rows, not files."""
    path = Path(source[len(PREFIX):] if is_hf_source(source) else source)
    if path.suffix == ".parquet" or (path.is_dir() and any(path.glob("*.parquet"))):
        return _parquet_files(path)
    ds = _load_from_disk(path, split)
    arrow = [Path(f["filename"]) for f in ds.cache_files]
    folder = arrow[0].parent if arrow else path
    return arrow + [p for p in (folder / "dataset_info.json", folder / "state.json") if p.is_file()]

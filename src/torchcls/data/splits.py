"""Which splits a source holds: train/val/test folders, a CSV `split` column, or the built-in sets.

A folder is a split layout when a sub-folder named train/, val/ or test/ holds class
folders (a class folder holds images). In such a layout every sub-folder must be a split
name, and every split must hold the same class folders: a mistyped `valid/` would
otherwise become a class, or silently go unused.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import IO

from torchcls.data.label_bounds import MAX_CLASSES, check_class_count
from torchcls.errors import UserError
from torchcls.io_files import open_regular

SPLIT_NAMES = ("train", "val", "test")
# Every read of a CSV manifest (its splits here, its rows in sources, its extra columns in governance) goes through
# csv_rows: a stream of rows, each bounded while it is read. Its bounds, in one place:
MAX_CSV_BYTES = 1 << 30  # a CSV manifest's file (~15 million rows of ~70 bytes)
MAX_CSV_ROWS = 20_000_000  # ImageNet-21k, the largest common image set, lists 14.2 million images
# csv bounds each field (131,072 characters) but not a row: 1 GiB of commas is a list of 1 billion fields. A row
# spans lines only inside quotes; a path, a label (or up to 1,000 of them) and a split are far below this.
MAX_CSV_ROW_CHARS = 1 << 20
# Distinct values of a `split` column kept while reading it: the splits are train, val and test (a few more are kept
# so that a misspelt one is named by the row check); a column of a million distinct values held them all.
MAX_CSV_SPLITS = 16


def _visible(folder: Path) -> list[Path]:
    """The entries of `folder` (a data root or a split: its entries are splits or class folders), refused past
    MAX_CLASSES and a few more before the rest is listed: a folder of a million entries is not a layout."""
    found: list[Path] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if not entry.name.startswith("."):
                    found.append(Path(entry.path))
                    if len(found) > MAX_CLASSES + len(SPLIT_NAMES):
                        check_class_count(len(found), str(folder), "entries (or more) where class folders are expected")
    except OSError:
        return []
    return sorted(found)


def _holds_class_folders(folder: Path) -> bool:
    entries = _visible(folder)
    return bool(entries) and all(p.is_dir() for p in entries)


def split_folders(root: Path) -> dict[str, Path] | None:
    """{split: folder} for a train/val/test layout, None for a plain ImageFolder."""
    subdirs = [d for d in _visible(root) if d.is_dir()]
    named = [d for d in subdirs if d.name in SPLIT_NAMES]
    if not named or not any(_holds_class_folders(d) for d in named):
        return None
    others = [d for d in subdirs if d.name not in SPLIT_NAMES]
    if others:
        holders = [d.name + "/" for d in named if _holds_class_folders(d)]
        raise UserError(f"{others[0]}: {root} looks like a split layout ({', '.join(holders)} "
                        f"{'holds' if len(holders) == 1 else 'hold'} class folders), but '{others[0].name}/' is not a split name. Rename it to "
                        "val/ or test/ (the only folders allowed next to train/), or move it out")
    folders = {d.name: d for d in named}
    reference_name = "train" if "train" in folders else named[0].name
    reference = [c.name for c in _visible(folders[reference_name]) if c.is_dir()]
    for name, folder in folders.items():
        classes = [c.name for c in _visible(folder) if c.is_dir()]
        if classes != reference:
            raise UserError(f"{folder}: its class folders differ from {folders[reference_name]}'s "
                            f"({_difference(reference, classes)}); every split needs the same class folders")
    return folders


def _difference(reference: list[str], other: list[str]) -> str:
    missing, extra = sorted(set(reference) - set(other)), sorted(set(other) - set(reference))
    parts = ([f"missing: {', '.join(missing[:10])}"] if missing else []) + \
            ([f"extra: {', '.join(extra[:10])}"] if extra else [])
    return "; ".join(parts) or "same names, different order"


def check_same_classes(expected: list[str], found: list[str], where: str, expected_from: str) -> None:
    """One clear error when a validation/test source has other classes than the training data."""
    if found != expected:
        raise UserError(f"{where}: its classes differ from the training data {expected_from} "
                        f"({_difference(expected, found)}); a validation or test set needs the same classes")


def _csv_lines(f: IO[str], csv_path: Path, used: list[int]) -> Iterator[str]:
    """The manifest's lines for csv.reader; `used` counts the characters of the row being read (reset by the
    caller after each row), refused past MAX_CSV_ROW_CHARS before csv splits them into fields."""
    line = 1
    while text := f.readline(MAX_CSV_ROW_CHARS + 1):
        used[0] += len(text)
        if used[0] > MAX_CSV_ROW_CHARS:
            raise UserError(f"{csv_path}: line {line}: a row of more than {MAX_CSV_ROW_CHARS:,} characters "
                            "(torchcls.data.splits.MAX_CSV_ROW_CHARS); a manifest row holds a path, a label and "
                            "a split: is it a CSV manifest, with its quotes closed?")
        line += text.endswith(("\n", "\r"))
        yield text


def csv_rows(csv_path: Path) -> Iterator[tuple[int, list[str]]]:
    """A CSV manifest as (line, cells): its header first (line 1; [] for an empty file), then each row that is not
    blank, with the line it ends on. Read as a stream under MAX_CSV_BYTES, MAX_CSV_ROWS and MAX_CSV_ROW_CHARS (each
    row refused before csv splits it); UserError for a row past them, a malformed row or text that is not UTF-8.
    Close it (contextlib.closing) when stopping early: it holds the file open."""
    used, rows = [0], 0
    with open_regular(csv_path, "r", newline="", what="CSV manifest", max_bytes=MAX_CSV_BYTES) as f:
        reader = csv.reader(_csv_lines(f, csv_path, used))
        try:
            header = next(reader, [])
            used[0] = 0
            yield reader.line_num, header
            for row in reader:
                used[0] = 0  # (the next row's characters are counted from here)
                if not row:  # a blank line (csv.DictReader skips them too)
                    continue
                rows += 1
                if rows > MAX_CSV_ROWS:
                    raise UserError(f"{csv_path}: more than {MAX_CSV_ROWS:,} rows (torchcls.data.splits.MAX_CSV_ROWS"
                                    "; ImageNet-21k lists 14.2 million images): is it the right file? Split a larger "
                                    "set into several manifests and write each as shards (torchcls data shard)")
                yield reader.line_num, row
        except csv.Error as e:  # a field over csv's 131,072-character limit, a NUL byte...
            raise UserError(f"{csv_path}: line {reader.line_num}: not a CSV row ({e})") from None
        except UnicodeDecodeError as e:
            raise UserError(f"{csv_path}: not UTF-8 text ({e.reason}); save the manifest as UTF-8") from None


def csv_splits(path: Path) -> set[str]:
    """The values of a CSV manifest's `split` column ({'train'} when it has none), read through csv_rows; more
    than MAX_CSV_SPLITS distinct values are refused as they are read."""
    with closing(csv_rows(path)) as rows:
        header = next(rows)[1]
        if "split" not in header:
            return {"train"}
        at, found = len(header) - 1 - header[::-1].index("split"), set()  # (a repeated name: its last column)
        for line, row in rows:
            value = row[at].strip() if at < len(row) else ""
            if value not in found:
                if len(found) >= MAX_CSV_SPLITS:
                    seen = ", ".join(repr(v[:20]) for v in sorted(found)[:5])
                    raise UserError(f"{path}: line {line}: its split column holds more than {MAX_CSV_SPLITS} distinct "
                                    f"values ({seen}, ...; torchcls.data.splits.MAX_CSV_SPLITS); each row's split is "
                                    f"one of {', '.join(SPLIT_NAMES)}")
                found.add(value)
    return found


def available_splits(source: str) -> set[str]:
    """The splits `source` holds on its own; 'train' alone means: split it with --val-fraction."""
    if source == "fashion-mnist":
        return {"train", "test"}
    path = Path(source)
    if path.is_dir():
        folders = split_folders(path)
        return set(folders) if folders else {"train"}
    if path.suffix.lower() == ".csv" and path.is_file():
        return csv_splits(path)
    return {"train"}

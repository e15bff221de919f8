"""WebDataset tar shards: write them from any source, describe them in `index.json`, open and check them.

A shard is a plain tar whose members are grouped into samples by key (`000000042.jpg`,
`000000042.cls`), the layout timm, OpenCLIP and DataComp read. Image files are stored as
their original bytes (no re-encode); in-memory sets (mnist-5k, fashion-mnist) as PNG.
`index.json` lists every shard with its sample count, size and SHA-256, plus the classes,
so a governance manifest can cite the data by hash and a reader knows the counts without
reading the tars.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, BinaryIO

from pydantic import Field, StringConstraints
from typing_extensions import NotRequired, TypedDict

from torchcls import sizes
from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.config import INT_RANGES
from torchcls.data.label_bounds import check_class_count, check_label_index
from torchcls.data.tar_headers import check_member_headers
from torchcls.errors import UserError
from torchcls.io_files import check_regular, open_regular, read_bytes
from torchcls.made_dirs import make_dir, remove_made
from torchcls.typed_json import NonNegative, check, sha256_type

if TYPE_CHECKING:
    from torchcls.data.sources import ImageSet

INDEX = "index.json"
INDEX_BYTES = 64 << 20  # an index lists shards, classes and skipped files: a few MB for millions of samples
# ... parsed under these bounds: 4 values a shard or a skipped file, 2 a class; nested 3 deep (skipped: [[f, why]]).
INDEX_BOUNDS = JsonBounds(max_bytes=INDEX_BYTES, max_values=4_000_000, max_depth=4, max_str=1 << 16)
MAX_CLS_BYTES = 64  # a .cls member: one class index in decimal, perhaps with a newline
FORMAT = "torchcls-webdataset-index"
IMAGE_EXTS = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "bmp", "gif", "tif", "tiff", "webp")
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's rule: key = up to the first dot
_BRACE = re.compile(r"\{\d+\.\.\d+\}")
MAX_SHARD_BYTES = 1 << 40  # one shard (--shard-size, an index's `bytes`): WebDataset's are 100 MB to a few GB
MAX_SHARD_FILES = 100_000  # shards of one set: one --data pattern's files, one index's list (100,000 of 1 GB: 100 TB)
# A sample is at least one tar member: a 512-byte header and a 512-byte block of data. So a shard of B bytes holds
# at most B // 1024 samples: an index's counts are bounded by the sizes _check_files compares with the files.
MIN_SAMPLE_BYTES = 1024


@dataclass(frozen=True)
class Shard:
    path: Path
    samples: int
    bytes: int
    sha256: str | None  # None for shards found without an index


@dataclass
class ShardSet:
    """Shards that together form one data set; what a streaming loader needs to split an epoch."""

    name: str
    classes: list[str]
    shards: list[Shard]
    channels: int = 3
    side: int | None = None  # fixed square size of every image, when the writer knew it
    source: str | None = None  # what the shards were written from (e.g. mnist-5k), from the index
    index: Path | None = None
    class_counts: list[int] | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # skipped when the shards were written

    def __len__(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def files(self) -> list[Path]:
        return [s.path for s in self.shards]


# index.json, typed as write_shards writes it and checked right after its bounded parse: class_counts sizes the
# --class-weights tensor, samples len(loader) and the schedule, channels and image_size the model's input, and each
# name is joined to the index's folder (a plain .tar name: no '/', no '..', not absolute, so it names a file there).
ShardName = Annotated[str, StringConstraints(pattern=r"^[^/\\\x00]+\.tar$", max_length=255)]
Channels = Annotated[int, Field(ge=INT_RANGES[("data", "channels")].lo, le=INT_RANGES[("data", "channels")].hi)]
Side = Annotated[int, Field(ge=INT_RANGES[("data", "img_size")].lo, le=INT_RANGES[("data", "img_size")].hi)]


class IndexedShard(TypedDict):
    name: ShardName
    samples: Annotated[int, Field(ge=1, le=MAX_SHARD_BYTES // MIN_SAMPLE_BYTES)]
    bytes: Annotated[int, Field(ge=1, le=MAX_SHARD_BYTES)]
    sha256: NotRequired[sha256_type() | None]


class ShardIndex(TypedDict):
    format: str
    shards: Annotated[list[IndexedShard], Field(min_length=1, max_length=MAX_SHARD_FILES)]
    classes: list[str]
    class_counts: NotRequired[list[NonNegative]]  # of len(classes), summing to the samples (_check_counts)
    channels: NotRequired[Channels | None]  # None: 3
    image_size: NotRequired[Side | None]  # None: images of any size
    source: NotRequired[str | None]
    skipped: NotRequired[list[Annotated[list[str], Field(min_length=2, max_length=2)]]]  # [file, why]
    version: NotRequired[int]
    num_samples: NotRequired[NonNegative]
    shuffled: NotRequired[bool]
    seed: NotRequired[int]


# ---------------------------------------------------------------- writing

def parse_size(text: str) -> int:
    """--shard-size: '1GB' -> 1_000_000_000, '512MiB' -> 536_870_912, at most MAX_SHARD_BYTES."""
    return sizes.parse_size(text, "--shard-size", MAX_SHARD_BYTES, "1TiB (shards.MAX_SHARD_BYTES)",
                            "500MB, 1GB or 2GiB")


class _HashingFile:
    """A write-only file that hashes and counts what passes through (tarfile's stream mode only writes)."""

    def __init__(self, path: Path):
        self.f: BinaryIO = path.open("wb")
        self.sha, self.size = hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def close(self) -> None:
        self.f.close()


def _sample_bytes(images: ImageSet, i: int) -> tuple[bytes, str]:
    """Sample i as (file bytes, extension): the file itself, or a PNG of an in-memory image."""
    if hasattr(images, "encoded"):  # rows of a table (hf:PATH): the stored bytes
        return images.encoded(i)
    if images.images is not None:
        from PIL import Image
        buf = io.BytesIO()
        Image.fromarray(images.images[i].numpy()).save(buf, format="PNG")
        return buf.getvalue(), "png"
    from torchcls.data.images import read_header, read_image_file
    path = Path(images.paths[i])
    ext = path.suffix.lower().lstrip(".")
    if ext not in IMAGE_EXTS:  # keep the true format visible to other readers
        ext = read_header(path)[0].lower()  # named from the bytes, never by Pillow
    return read_image_file(path), ext  # a regular file of at most image_formats.Bounds.max_file_bytes


def _checked_sample(images: ImageSet, i: int) -> tuple[bytes, str]:
    from torchcls.data.images import BadImage
    try:
        return _sample_bytes(images, i)
    except BadImage as e:  # a row of a table (never scanned), or a file that changed after the scan
        where = f"{images.paths[i]}: " if getattr(images, "paths", None) else ""  # (a row's reason names its row)
        raise UserError(f"{where}{e}; no shards were written (fix or remove it and run again)") from None


def write_shards(source: str | ImageSet, out_dir: str | Path, shard_size_bytes: int = 1_000_000_000, *,
                 prefix: str = "train", max_count: int = 100_000, shuffle: bool = True, seed: int = 0,
                 root: str | None = None, channels: int | None = None, on_bad_file: str = "error") -> ShardSet:
    """Write `source` (a --data value or an ImageSet) as WebDataset shards plus index.json into `out_dir`.

    Samples are written in a seeded random order (`shuffle`), so every shard mixes the classes
    and a streaming reader only needs to shuffle shards and small blocks. Everything is written
    under a temporary name and renamed at the end: `out_dir` either holds a complete set or nothing.
    """
    import torch
    from webdataset import TarWriter

    if isinstance(source, str):
        from torchcls.data.sources import open_source
        images = open_source(source, root, "train", channels, on_bad_file)
    else:
        images = source
    if images.targets.ndim != 1:  # a multi-label CSV: its rows of 0/1 have no one class to write
        raise UserError(f"{images.origin or images.name}: shards hold one class per sample (KEY.cls), and this "
                        "data has a multi-label `labels` column; train --task multilabel from the CSV itself")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty; remove it or choose another folder")
    if shard_size_bytes <= 0 or max_count <= 0:
        raise UserError(f"--shard-size must be positive (got {shard_size_bytes} bytes, {max_count} samples)")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", prefix):
        raise UserError(f"shard prefix {prefix!r}: use letters, digits, '-' and '_' only")
    order = (torch.randperm(len(images), generator=torch.Generator().manual_seed(seed)) if shuffle
             else torch.arange(len(images))).tolist()
    out.parent.mkdir(parents=True, exist_ok=True)
    made = make_dir(out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")  # new: only ours
    tmp = made.path
    try:
        shards = _write_tars(images, order, tmp, prefix, shard_size_bytes, max_count, TarWriter)
        counts = torch.bincount(images.targets, minlength=len(images.classes)).tolist()
        index = {"format": FORMAT, "version": 1, "source": images.name, "classes": list(images.classes),
                 "channels": images.channels, "image_size": images.side, "num_samples": len(order),
                 "class_counts": counts, "shuffled": shuffle, "seed": seed,
                 "skipped": [list(s) for s in images.skipped],
                 "shards": [{"name": s.path.name, "samples": s.samples, "bytes": s.bytes, "sha256": s.sha256}
                            for s in shards]}
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    except BaseException:
        remove_made(made)
        raise
    return open_shards(str(out))


def _write_tars(images: ImageSet, order: list[int], tmp: Path, prefix: str, max_bytes: int, max_count: int,
                tar_writer: type) -> list[Shard]:
    shards: list[Shard] = []
    sink = writer = None
    count = 0

    def close() -> None:
        writer.close()
        sink.close()
        path = tmp / f"{prefix}-{len(shards):06d}.tar"
        shards.append(Shard(path, count, path.stat().st_size, sink.sha.hexdigest()))

    for n, i in enumerate(order):
        if writer is None:
            sink = _HashingFile(tmp / f"{prefix}-{len(shards):06d}.tar")
            # Fixed mtime and owner: the same data always gives the same bytes, so the same hashes.
            writer, count = tar_writer(sink, encoder=False, mtime=0, user="torchcls", group="torchcls"), 0
        data, ext = _checked_sample(images, i)
        writer.write({"__key__": f"{n:09d}", ext: data, "cls": str(int(images.targets[i])).encode()})
        count += 1
        if sink.size + len(data) >= max_bytes or count >= max_count:
            close()
            writer = None
    if writer is not None:
        close()
    return shards


# ---------------------------------------------------------------- reading

def split_name(name: str) -> tuple[str, str] | None:
    """A tar member name -> (sample key, field extension), by webdataset's rule; None for no extension."""
    m = _KEY_EXT.match(name)
    return (m.group(1), m.group(2)) if m else None


def iter_members(tf: tarfile.TarFile, shard: Path, file_size: int) -> Iterator[tuple[str, dict[str, tarfile.TarInfo]]]:
    """Group a tar's members into samples (key, {ext: member}) reading headers only, each header chain checked
    (check_member_headers) before tarfile parses it.

    A member whose data would end past the end of the file means the shard was cut short. Every member must have a
    size >= 0 and lie after the one before (its header, and where tarfile reads the next, strictly further on): a
    size tarfile took from elsewhere that moved it backwards would parse the same members forever.
    """
    key, fields, checked, last = None, {}, 0, -1  # (open_tar checked the headers at byte 0)
    while True:
        if tf.offset != checked:
            check_member_headers(tf.fileobj, tf.offset, file_size, shard)  # before tarfile parses them
            tf.fileobj.seek(checked := tf.offset)
        try:
            m = tf.next()
        except (tarfile.TarError, EOFError, OSError) as e:
            raise UserError(f"shard {shard}: unreadable tar ({e}); it is truncated or not a tar file. "
                            "Re-copy or re-write it (torchcls data shard)") from None
        if m is None:
            _check_end(tf, shard)
            break
        if m.size < 0 or m.offset <= last or tf.offset <= m.offset:
            problem = f"a size of {m.size:,} bytes" if m.size < 0 else \
                f"the next header at byte {tf.offset:,}, not after it" if m.offset > last else \
                f"a header at byte {m.offset:,}, not after the member before it (at byte {last:,})"
            raise UserError(f"shard {shard}: member {m.name!r} has {problem}: tar members follow one another. It is "
                            "corrupt or not a shard; re-write it (torchcls data shard)")
        last = m.offset
        if m.offset_data + m.size > file_size:
            raise UserError(f"shard {shard} is truncated: member {m.name} ends at byte "
                            f"{m.offset_data + m.size:,} of a {file_size:,}-byte file. Re-copy or re-write it")
        parts = split_name(m.name) if m.isfile() else None
        if parts is None:
            continue
        if parts[0] != key and key is not None:
            yield key, fields
            fields = {}
        key = parts[0]
        fields[parts[1]] = m
    if key is not None:
        yield key, fields


def _check_end(tf: tarfile.TarFile, shard: Path) -> None:
    # tarfile takes a file cut exactly between two members for a finished archive; a real one
    # ends with a block of zeros (the end-of-archive marker), which a cut-short copy lacks.
    tf.fileobj.seek(tf.offset)
    end = tf.fileobj.read(tarfile.BLOCKSIZE)
    if len(end) < tarfile.BLOCKSIZE or end.strip(b"\0"):
        raise UserError(f"shard {shard} is truncated: it stops at byte {tf.offset:,} without the tar "
                        "end-of-archive marker. Re-copy or re-write it")


@contextmanager
def open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    """The shard `path` as an uncompressed tar, read from a regular file only (a FIFO would block)."""
    try:
        f = open_regular(path, what="shard")
    except OSError as e:
        raise UserError(f"shard {path}: cannot open as a tar ({e}). Re-copy or re-write it") from None
    with f:
        check_member_headers(f, 0, os.fstat(f.fileno()).st_size, path)  # tarfile parses the first member on open
        f.seek(0)
        try:
            tf = tarfile.open(fileobj=f, mode="r:")  # (a TarFile given a file object leaves it open: `with f`)
        except (tarfile.TarError, OSError) as e:
            raise UserError(f"shard {path}: cannot open as a tar ({e}). Re-copy or re-write it") from None
        with tf:
            yield tf


def is_shard_source(source: str) -> bool:
    """True for a folder with index.json or only .tar files, a .tar file, or a brace pattern of .tar files."""
    if _BRACE.search(source) or source.endswith(".tar"):
        return True
    path = Path(source)
    if not path.is_dir():
        return False
    if (path / INDEX).is_file():
        return True
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    return bool(entries) and all(p.is_file() and p.suffix == ".tar" for p in entries)


# A --data pattern names at most MAX_SHARD_FILES files, and the characters of those names in all are bounded as
# names x the pattern's length (no name is longer than its pattern: a range's names are no wider than its end
# points): each name carries the pattern's literal text, so a 250 KB pattern naming 100,000 files was 25 GB of
# names. 64 Mi characters: 100,000 names of 671 characters.
MAX_PATTERN_CHARS = 64 << 20
_BRACE_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?|([A-Za-z])\.\.([A-Za-z])(?:\.\.(-?\d+))?")


def brace_names_bound(pattern: str) -> int:
    """How many names braceexpand(pattern) yields (capped at MAX_SHARD_FILES + 1), counted without expanding:
    braceexpand builds each range in full before its first name ({0..999999999}: 10^9 strings). A group's
    count is the sum over its alternatives of the product of the groups in each (a range: its length)."""
    cap, frames, i = MAX_SHARD_FILES + 1, [[0, 0, 1, False]], 0  # per level: start, sum, product, comma seen
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "{":
            frames.append([i, 0, 1, False])
        elif c == "," and len(frames) > 1:
            frame = frames[-1]
            frame[1], frame[2], frame[3] = min(frame[1] + frame[2], cap), 1, True
        elif c == "}" and len(frames) > 1:
            start, total, product, comma = frames.pop()
            m = None if comma else _BRACE_RANGE.fullmatch(pattern[start + 1:i])
            if m is None:
                size = total + product
            else:
                a, b = (int(m[1][:19]), int(m[2][:19])) if m[1] else (ord(m[4]), ord(m[5]))
                size = abs(b - a) // (abs(int((m[3] or m[6] or "1")[:19])) or 1) + 1
            frames[-1][2] = min(frames[-1][2] * size, cap)
        i += 1
    return frames[0][2]


def _expand(source: str) -> list[Path]:
    from braceexpand import braceexpand
    names = brace_names_bound(source)
    shown = source if len(source) <= 200 else f"{source[:100]}...{source[-60:]} ({len(source):,} characters)"
    if names > MAX_SHARD_FILES:
        raise UserError(f"--data {shown}: the pattern may name more than {MAX_SHARD_FILES:,} shard files "
                        "(shards.MAX_SHARD_FILES): refused before expanding it; name fewer, or a folder of shards")
    if names * len(source) > MAX_PATTERN_CHARS:
        raise UserError(f"--data {shown}: the pattern may name {names:,} shard files of up to {len(source):,} "
                        f"characters each, more than {MAX_PATTERN_CHARS:,} characters in all "
                        "(shards.MAX_PATTERN_CHARS): refused before expanding it; shorten the path (a folder of "
                        "shards), or name fewer")
    paths = [Path(p) for p in braceexpand(source)]
    missing = [str(p) for p in paths if not _exists(p)]  # (anything else is refused when opened: a FIFO...)
    if missing:
        raise UserError(f"--data {source}: {len(missing)} of {len(paths)} shard(s) not found, e.g. {missing[0]}")
    return paths


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the file system (ENAMETOOLONG): no such shard
        return False


def _read_index(path: Path) -> dict:
    try:
        index = load_bounded(read_bytes(path, max_bytes=INDEX_BYTES, what="shard index"), INDEX_BOUNDS, str(path))
    except OSError as e:
        raise UserError(f"{path}: unreadable shard index ({e}); re-write the shards (torchcls data shard)") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("shards"), list):
        raise UserError(f"{path} is not a torchcls shard index (no '\"format\": \"{FORMAT}\"'); "
                        "remove it to have the shards scanned instead")
    return index


def open_shards(source: str, verify: bool = False) -> ShardSet:
    """Open shards from a folder, a .tar file or a brace pattern (`shards/train-{000000..000099}.tar`).

    With an index.json next to the shards, counts and classes come from it and each shard's size
    is checked against it (a cut-short copy is caught at once); `verify` also re-hashes every shard.
    Without one, every shard's headers are read to count its samples (labels become class names '0'..).
    """
    path = Path(source)
    try:
        is_dir = path.is_dir()
    except OSError:  # a name too long for the file system (a long pattern): not a folder; _expand bounds it
        is_dir = False
    if is_dir:
        folder, chosen = path, None
        if not (path / INDEX).is_file():
            chosen = sorted(p for p in path.iterdir() if p.suffix == ".tar" and not p.name.startswith("."))
    else:
        chosen = _expand(source)
        folder = chosen[0].parent
    index_path = folder / INDEX
    if index_path.is_file():
        shardset = _from_index(index_path, source, chosen)
        if shardset is not None:
            _check_files(shardset, verify)
            return shardset
    if not chosen:
        raise UserError(f"--data {source}: no .tar shards found")
    return _scan(source, chosen)


def _from_index(index_path: Path, source: str, chosen: list[Path] | None) -> ShardSet | None:
    index = check(_read_index(index_path), ShardIndex, str(index_path),
                  hint="re-write the shards (torchcls data shard) or remove it to have the shards scanned")
    _check_counts(index, index_path)
    return _shardset_of(index, index_path, source, chosen)  # (every field it reads is typed by ShardIndex)


def _check_counts(index: dict, index_path: Path) -> None:
    """Counts that agree with each other (typed and ranged by ShardIndex): a shard's samples fit its bytes, and
    class_counts has one count per class, summing to the samples (what write_shards records)."""
    crowded = next((s for s in index["shards"] if s["samples"] > s["bytes"] // MIN_SAMPLE_BYTES), None)
    if crowded is not None:
        raise UserError(f"{index_path}: shard {crowded['name']} records {crowded['samples']:,} samples in "
                        f"{crowded['bytes']:,} bytes, more than one per {MIN_SAMPLE_BYTES} bytes (a tar member's "
                        "header and data block); re-write the shards (torchcls data shard)")
    counts, total = index.get("class_counts"), sum(s["samples"] for s in index["shards"])
    if counts is not None and (len(counts) != len(index["classes"]) or sum(counts) != total):
        raise UserError(f"{index_path}: class_counts lists {len(counts):,} counts summing to {sum(counts):,}, but the "
                        f"index has {len(index['classes']):,} classes and {total:,} samples; re-write the shards "
                        "(torchcls data shard) or remove it to have the shards scanned")


def _shardset_of(index: dict, index_path: Path, source: str, chosen: list[Path] | None) -> ShardSet | None:
    entries = {e["name"]: e for e in index["shards"]}
    names = [p.name for p in chosen] if chosen is not None else list(entries)
    if any(n not in entries for n in names):
        return None  # shards the index does not describe: scan them instead
    # (typed and ranged by ShardIndex: each name a plain .tar name, so every path is a file of the index's folder)
    shards = [Shard(index_path.parent / n, entries[n]["samples"], entries[n]["bytes"], entries[n].get("sha256"))
              for n in names]
    whole = chosen is None or len(names) == len(entries)
    classes = index["classes"]
    check_class_count(len(classes), str(index_path))
    return ShardSet(source, list(classes), shards, index.get("channels") or 3,
                    index.get("image_size"), index.get("source"), index_path,
                    index.get("class_counts") if whole else None,
                    [tuple(s) for s in index.get("skipped", [])])


def _check_files(shardset: ShardSet, verify: bool) -> None:
    for s in shardset.shards:
        if not s.path.exists():
            raise UserError(f"shard {s.path} is listed in {shardset.index} but missing")
        check_regular(s.path, what="shard")  # (a FIFO's size says nothing, and reading it would block)
        size = s.path.stat().st_size
        if size == 0:
            raise UserError(f"shard {s.path} is empty (0 bytes); re-copy or re-write it")
        if size != s.bytes:
            raise UserError(f"shard {s.path} has {size:,} bytes but {shardset.index} records {s.bytes:,}: "
                            "it is truncated or was changed. Re-copy it or re-write the shards")
    if verify:
        verify_shards(shardset)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path, what="shard") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_shards(shardset: ShardSet) -> dict[str, str]:
    """Re-hash every shard and compare with the index; returns {shard name: sha256}. For governance and --data."""
    hashes, bad = {}, []
    for s in shardset.shards:
        hashes[s.path.name] = digest = sha256_file(s.path)
        if s.sha256 is not None and digest != s.sha256:
            bad.append(f"  {s.path}: sha256 {digest[:16]}... but the index records {s.sha256[:16]}...")
    if bad:
        raise UserError(f"{len(bad)} shard(s) disagree with {shardset.index}:\n" + "\n".join(bad) +
                        "\nThe files were changed or corrupted after writing; re-copy them or re-write the shards")
    return hashes


def _scan(source: str, paths: list[Path]) -> ShardSet:
    """Count samples and collect labels of shards that have no index (headers and .cls members only)."""
    shards, top = [], -1
    for p in paths:
        check_regular(p, what="shard")
        size = p.stat().st_size
        if size == 0:
            raise UserError(f"shard {p} is empty (0 bytes); re-copy or re-write it")
        with open_tar(p) as tf:
            n = 0
            for key, fields in iter_members(tf, p, size):
                n += 1
                if "cls" in fields and 0 <= fields["cls"].size <= MAX_CLS_BYTES:  # (a longer one is no label)
                    raw = tf.extractfile(fields["cls"]).read(MAX_CLS_BYTES)
                    top = max(top, int(raw)) if raw.strip().isdigit() else top
                    check_label_index(top, f"shard {p}: sample {key}")  # before a name is made for each class
        if n == 0:
            raise UserError(f"shard {p} holds no samples")
        shards.append(Shard(p, n, size, None))
    if top < 1:
        raise UserError(f"--data {source}: the shards carry no integer .cls labels (or only one class)")
    return ShardSet(source, [str(c) for c in range(top + 1)], shards)


def split_shards(shardset: ShardSet, val_fraction: float, seed: int) -> tuple[ShardSet, ShardSet | None]:
    """Hold out whole shards for validation (--val-fraction on shards): a seeded choice of
    round(fraction x shards) shards, at least one. Every sample lands in exactly one part, and
    nothing is read; the shards mix the classes when they were written shuffled (the default)."""
    if val_fraction <= 0:
        return shardset, None
    n = len(shardset.shards)
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise UserError(f"{shardset.name}: {n} shard(s) cannot give a validation share of {val_fraction}; "
                        "write smaller shards (--shard-size), pass --val-data, or --val-fraction 0")
    import torch
    chosen = set(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:n_val].tolist())

    def part(keep: bool) -> ShardSet:
        shards = [s for i, s in enumerate(shardset.shards) if (i in chosen) != keep]
        return ShardSet(shardset.name, shardset.classes, shards, shardset.channels, shardset.side,
                        shardset.source, shardset.index)

    return part(True), part(False)


def describe(shardset: ShardSet) -> dict:
    """What a governance manifest cites for a shard set: the index's own hash, and each shard's
    name, sample count, size and SHA-256 as recorded (verify_shards checks them against the files)."""
    return {"format": "webdataset", "index": str(shardset.index) if shardset.index else None,
            "index_sha256": sha256_file(shardset.index) if shardset.index else None,
            "classes": list(shardset.classes), "num_samples": len(shardset),
            "shards": [{"name": s.path.name, "samples": s.samples, "bytes": s.bytes, "sha256": s.sha256}
                       for s in shardset.shards]}

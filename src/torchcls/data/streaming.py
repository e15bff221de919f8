"""Stream WebDataset shards for training: each sample once per epoch over all ranks and workers,
a seeded order, and an exact mid-epoch resume that never decodes a sample twice.

How an epoch is laid out (all of it a function of seed, epoch, rank, world, workers, batch size):
1. The shards are put in a seeded order for the epoch; their samples, concatenated, form one
   stream of N positions (the counts come from the index, nothing is read to know them).
2. Rank r takes the contiguous range [N*r/world, N*(r+1)/world): sizes differ by at most one, so
   every rank runs the same number of steps whenever that is possible at all.
3. Within a rank, workers take contiguous runs of whole batches, so each worker's batches are
   full except the rank's very last one.
4. A worker reads its range sequentially in blocks of `block` samples (raw bytes only) and
   yields each block in a seeded permutation. Its state is one number, the positions consumed;
   resuming seeks to the block (tar headers only) and skips, without decoding, what was used.
Augmentation randomness is seeded per sample from (seed, epoch, position), so a resumed run
draws the same crops and flips as an uninterrupted one, whatever process decodes the sample.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import tarfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from typing_extensions import TypedDict

from torchcls.data import images as image_files
from torchcls.data.images import decode_bytes
from torchcls.data.shards import IMAGE_EXTS, MAX_CLS_BYTES, ShardSet, iter_members, open_tar
from torchcls.data.worker_start import worker_context
from torchcls.errors import UserError
from torchcls.io_files import open_regular
from torchcls.typed_json import check

Transform = Callable[[torch.Tensor], torch.Tensor]
# A worker holds one shuffle block's raw bytes: `block` samples (1,000 by default) of up to 256 MiB each could be
# 256 GiB. Past this many bytes, a block's further samples are held as where they lie in their shard and read again
# when they are used: the order, and so a resume, stays the same. (1,000 ImageNet JPEGs are ~110 MB.)
MAX_BLOCK_BYTES = 512 << 20
Span = tuple[int, int, str]  # a member's data: offset in the shard, size, name
MAX_EPOCH = 10**15  # as checkpoint/sharded_state.MAX_COUNTER: an epoch number a saved state may hold


class BadShardSample(Exception):
    """A sample that cannot be used, under --on-bad-file error; str() names the shard and key."""


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from integers of any size, the same in every process and Python run."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def epoch_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_shards))
    g = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_shards, generator=g).tolist()


def rank_range(n: int, rank: int, world: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def worker_range(n: int, rank: int, world: int, worker: int, workers: int, batch_size: int) -> tuple[int, int]:
    """The stream positions [lo, hi) that one worker of one rank reads in an epoch."""
    lo, hi = rank_range(n, rank, world)
    batches = math.ceil((hi - lo) / batch_size)
    first, last = batches * worker // workers, batches * (worker + 1) // workers
    return min(lo + first * batch_size, hi), min(lo + last * batch_size, hi)


class ShardStream(IterableDataset):
    """The per-rank streaming dataset; a torchdata `Stateful` (state_dict/load_state_dict) in each worker."""

    def __init__(self, shardset: ShardSet, *, batch_size: int, seed: int, rank: int, world: int,
                 transform: Transform | None, on_bad_file: str, channels: int | None = None,
                 shuffle: bool = True, block: int = 1000, min_side: int | None = None,
                 max_pixels: int = image_files.MAX_PIXELS):
        if not 0 <= rank < world:
            raise UserError(f"rank {rank} is outside a world of {world} process(es)")
        self.files = [(str(s.path), s.samples) for s in shardset.shards]
        self.num_samples = sum(n for _, n in self.files)
        self.num_classes = len(shardset.classes)
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.transform, self.on_bad_file = transform, on_bad_file
        self.channels = channels or shardset.channels
        self.min_side, self.max_pixels = min_side, max_pixels
        self.shuffle, self.block = shuffle, max(1, block) if shuffle else 1
        self.epoch, self._pos, self._resume, self._workers = 0, 0, False, 1
        self.skipped: list[list[str]] = []

    # -- torchdata Stateful: called in the worker after every batch, so it must be cheap
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self._pos, "skipped": list(self.skipped),
                "layout": [self.rank, self.world, self._workers, self.batch_size, self.num_samples]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._pos, self.skipped = int(state["epoch"]), int(state["pos"]), list(state["skipped"])
        self._resume, self._saved_layout = True, list(state["layout"])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        worker, self._workers = (info.id, info.num_workers) if info is not None else (0, 1)
        layout = [self.rank, self.world, self._workers, self.batch_size, self.num_samples]
        if self._resume and self._saved_layout != layout:
            raise UserError(f"the saved data-loader state was made with rank, world, workers, batch size, samples "
                            f"= {self._saved_layout}, this run has {layout}; resume with the same --workers, "
                            "--batch-size, process count and data")
        start, self._resume = (self._pos if self._resume else 0), False
        self._pos = start
        if not start:
            self.skipped = []
        lo, hi = worker_range(self.num_samples, self.rank, self.world, worker, self._workers, self.batch_size)
        return self._samples(lo, hi, start)

    def _samples(self, lo: int, hi: int, start: int) -> Iterator[tuple[torch.Tensor, int]]:
        first = start // self.block * self.block
        budget = [0]  # bytes the block being read may still hold (_read takes from it)
        raw = self._read(lo + first, hi, budget)
        for b in range(lo + first, hi, self.block):
            budget[0] = MAX_BLOCK_BYTES
            chunk = list(itertools.islice(raw, min(self.block, hi - b)))
            if len(chunk) < min(self.block, hi - b):
                raise UserError(f"the shards of this data set hold fewer samples than their index records "
                                f"(stream position {b + len(chunk)}); re-write them or remove the stale index.json")
            perm = self._permutation(b, len(chunk))
            skip = start - first if b == lo + first else 0
            for j in range(skip, len(chunk)):
                self._pos = b - lo + j + 1  # consumed, whether it is used or skipped as bad
                item = self._make(chunk[perm[j]], b + perm[j])
                if item is not None:
                    yield item

    def _permutation(self, block_start: int, n: int) -> list[int]:
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch, block_start))
        return torch.randperm(n, generator=g).tolist()

    def _read(self, pos: int, hi: int, budget: list[int]) -> Iterator[tuple[str, str, dict[str, bytes] | Later]]:
        """Raw samples (shard, key, {ext: bytes}) from stream position `pos` on, reading only what is used; a
        sample whose bytes would take `budget` below zero is left in its shard (Later), read when it is used."""
        order = epoch_order(len(self.files), self.seed, self.epoch, self.shuffle)
        base = 0
        for s in order:
            path, count = self.files[s]
            if base + count <= pos:
                base += count
                continue
            skip, seen = max(0, pos - base), 0
            with open_tar(path) as tf:
                for n, (key, members) in enumerate(iter_members(tf, path, os.path.getsize(path))):
                    if base + n >= hi:
                        return
                    seen = n + 1
                    if n >= count:
                        break
                    if n >= skip:  # before: headers read to find the way, data never touched
                        spans = _sample_spans(members)
                        size = sum(span[1] for span in spans.values() if span)
                        if size > budget[0]:
                            yield path, key, Later(spans)
                            continue
                        budget[0] -= size
                        yield path, key, _read_spans(tf.fileobj, spans, path)
            if seen != count:
                raise UserError(f"shard {path} does not hold the {count} samples its index records; "
                                "re-write the shards, or remove the stale index.json to have them counted")
            base += count

    def _make(self, raw: tuple[str, str, dict[str, bytes] | Later], position: int) -> tuple[torch.Tensor, int] | None:
        shard, key, fields = raw
        if isinstance(fields, Later):
            fields = fields.read(shard)
        try:
            image, label = self._decode(fields)
        except (image_files.BadImage, ValueError) as e:
            if self.on_bad_file == "error":
                raise BadShardSample(f"shard {shard}: sample {key}: {e}. Fix or re-write the shard, or pass "
                                     "--on-bad-file skip to leave such samples out (they are counted and listed)")
            self.skipped.append([shard, key, str(e)])
            return None
        if self.transform is not None:
            # The CPU generator alone (torch.manual_seed also records stacks for lazy CUDA seeding,
            # ~3 ms a call), restored afterwards so the caller's random stream is untouched.
            gen = torch.default_generator
            saved = gen.get_state()
            gen.manual_seed(mix_seed(self.seed, self.epoch, position, 1))
            try:
                image = self.transform(image)
            finally:
                gen.set_state(saved)
        return image, label

    def _decode(self, fields: dict[str, bytes | None]) -> tuple[torch.Tensor, int]:
        label_raw = fields.get("cls")
        ext = _image_ext(fields)
        if ext is None or label_raw is None:
            raise ValueError(f"needs an image ({'/'.join(IMAGE_EXTS[:3])}...) and a .cls label of at most "
                             f"{MAX_CLS_BYTES} bytes; has {', '.join('.' + e for e in fields) or 'nothing'}")
        if fields[ext] is None:
            raise image_files.BadImage(f"its .{ext} member is larger than an image is read "
                                       f"({image_files.BOUNDS.max_file_bytes:,} bytes, image_formats.Bounds)")
        text = label_raw.decode("utf-8", "replace").strip()
        if not text.isdigit() or int(text) >= self.num_classes:
            raise ValueError(f"label {text!r} is not a class index in 0..{self.num_classes - 1}")
        return decode_bytes(fields[ext], self.channels, self.min_side, self.max_pixels), int(text)


def _image_ext(fields: dict) -> str | None:
    """The member a sample is decoded from: its first with an image extension."""
    return next((e for e in fields if e.lower() in IMAGE_EXTS), None)


def _sample_spans(members: dict[str, tarfile.TarInfo]) -> dict[str, Span | None]:
    """{ext: where its data lies} of the two members a sample is decoded from (its image and its .cls), each only
    when within its bound (0 to the bound: a negative size would be read(-1), the rest of the shard); every other
    member (and one outside its bound) is named with None, never read."""
    image, limits = _image_ext(members), {"cls": MAX_CLS_BYTES}
    if image is not None:
        limits[image] = image_files.BOUNDS.max_file_bytes
    return {ext: (m.offset_data, m.size, m.name) if 0 <= m.size <= limits.get(ext, -1) else None
            for ext, m in members.items()}


def _read_spans(f: Any, spans: dict[str, Span | None], shard: str) -> dict[str, bytes | None]:
    return {ext: _read_span(f, span, shard) if span is not None else None for ext, span in spans.items()}


def _read_span(f: Any, span: Span, shard: str) -> bytes:
    # A plain seek + read: tarfile's extractfile wrapper costs more than the read of a small image.
    offset, size, name = span
    if size < 0:  # (iter_members refuses such a member; read(-1) would read the rest of the shard)
        raise UserError(f"shard {shard}: member {name} has a negative size ({size:,}); re-write the shard")
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise UserError(f"shard {shard} is truncated inside member {name}; re-copy or re-write it")
    return data


class Later:
    """A sample read past its block's MAX_BLOCK_BYTES: where its members lie, read from the shard when used."""

    def __init__(self, spans: dict[str, Span | None]):
        self.spans = spans

    def read(self, shard: str) -> dict[str, bytes | None]:
        with open_regular(shard, what="shard") as f:
            return _read_spans(f, self.spans, shard)


def _clean_message(e: BaseException) -> str:
    """The user's message from an exception a DataLoader worker re-raised with its traceback appended."""
    msg = str(e)
    for marker in ("BadShardSample: ", "UserError: "):
        if "Original Traceback" in msg and marker in msg:
            return msg.rsplit(marker, 1)[1].strip()
    return msg


class ShardLoader:
    """Batches of (images, targets) for one rank; `state_dict()` mid-epoch, `load_state_dict()` in a new
    loader, and the next batches are those the uninterrupted loader would have given.

    Call `set_epoch(e)` before each epoch (a loaded state carries its own epoch). Workers are not
    persistent: each epoch's layout is handed to freshly started workers.
    """

    def __init__(self, dataset: ShardStream, workers: int, pin_memory: bool | None = None):
        from torchdata.stateful_dataloader import StatefulDataLoader
        self.dataset = dataset
        with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(
                dataset, batch_size=dataset.batch_size, num_workers=workers, snapshot_every_n_steps=1,
                multiprocessing_context=worker_context(workers),
                pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
        self._skipped: list[list[str]] = []

    def __len__(self) -> int:
        """Batches this rank yields per epoch. Ranks hold N//world or N//world + 1 samples, so the
        counts differ only where no split can avoid it: N//world a multiple of the batch size and
        N not a multiple of world (then the ranks with one sample more run one step more)."""
        lo, hi = rank_range(self.dataset.num_samples, self.dataset.rank, self.dataset.world)
        return math.ceil((hi - lo) / self.dataset.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        it = iter(self.loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            except (BadShardSample, UserError) as e:
                raise UserError(_clean_message(e)) from None
            yield batch
        self._skipped = _collect_skipped(self.loader.state_dict()) if self.loader.num_workers else \
            list(self.dataset.skipped)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any, where: str = "the data-loader state") -> None:
        """Resume from `state` (what state_dict gave, read back from `where`): checked first (check_saved_state)."""
        check_saved_state(self, state, where)
        self.loader.load_state_dict(state)

    @property
    def skipped(self) -> list[list[str]]:
        """[shard, key, reason] of each bad sample left out in the last complete epoch (--on-bad-file skip)."""
        return list(self._skipped)


# -- the saved state, checked before torchdata sees it
# torchdata's StatefulDataLoader takes its state as it is and loops over counts in it when a resume starts
# (`range(_last_yielded_worker_id + 1)`, `range(_steps_since_snapshot)` fetching a batch each, `range(_num_yielded)`
# when it fast-forwards), asserts on others, and hands each worker's part to ShardStream. Read from a run dir, that
# state is the file's, so each field is typed (the schemas below: what torchdata 0.11 writes for this loader, whose
# dataset is a ShardStream and whose sampler is the iterable one) and each count held to what this loader can have
# produced in one epoch (check_saved_state): a resume does at most an epoch's work, whatever the file says.

class _Stream(TypedDict):  # ShardStream.state_dict
    epoch: int
    pos: int
    skipped: list[list[str]]
    layout: list[int]


class _Fetcher(TypedDict):
    fetcher_ended: bool
    dataset_iter_state: None  # ShardStream's iterator is a generator: it has no state of its own


class _SamplerIter(TypedDict):
    samples_yielded: int


class _OneProcess(TypedDict):  # --workers 0
    _index_sampler_state: None
    _sampler_iter_state: _SamplerIter
    _sampler_iter_yielded: int
    _num_yielded: int
    _IterableDataset_len_called: int | None
    _shared_seed: None
    fetcher_state: _Fetcher
    dataset_state: _Stream
    _iterator_finished: bool


class _Worker(TypedDict):
    worker_id: int
    dataset_state: _Stream | None
    fetcher_state: _Fetcher


class _Main(TypedDict):
    _num_workers: int
    _sampler_iter_state: _SamplerIter
    _index_sampler_state: None
    _sampler_iter_yielded: int
    _IterableDataset_len_called: int | None
    _shared_seed: None
    _base_seed: int


class _Snapshot(TypedDict):
    _snapshot_step: int
    _last_yielded_worker_id: int
    _main_snapshot: _Main
    _worker_snapshots: dict[str, _Worker]


class _Workers(TypedDict):  # --workers N
    _snapshot: _Snapshot
    _steps_since_snapshot: int
    _iterator_finished: bool


def check_saved_state(loader: ShardLoader, state: Any, where: str) -> None:
    """`state` (read from `where`) is one this loader can have saved mid-epoch, or a UserError that says to resume
    from the epoch's start without it. Every count torchdata loops over on resume is at most the epoch's batches."""
    hint = (f"delete {where} to resume without it (the epoch's batches up to the checkpoint are read again and "
            "passed over), or start the run over")
    workers, batches = loader.loader.num_workers, len(loader)
    check(state, _Workers if workers else _OneProcess, where, hint)
    # The sampler is the iterable kind's (one index per batch, never replayed): what the workers were asked for
    # is the epoch's batches plus, at most, a prefetch round and one end-of-data request each.
    asked = batches + ((loader.loader.prefetch_factor or 0) + 2) * max(workers, 1)
    if not workers:
        _within(state["_num_yielded"], batches, "_num_yielded", where, hint)
        _main_counts(loader, state, asked, where, hint)
        _check_stream(loader, state["dataset_state"], 0, where, hint)
        return
    snap = state["_snapshot"]
    _within(snap["_snapshot_step"], batches, "_snapshot._snapshot_step", where, hint)
    _within(state["_steps_since_snapshot"], batches - snap["_snapshot_step"], "_steps_since_snapshot", where, hint)
    _within(snap["_last_yielded_worker_id"] + 1, workers, "_snapshot._last_yielded_worker_id + 1", where, hint)
    main = snap["_main_snapshot"]
    if main["_num_workers"] != workers or set(snap["_worker_snapshots"]) != {f"worker_{i}" for i in range(workers)}:
        raise UserError(f"{where} was saved with {main['_num_workers']} loader workers, this run has {workers}: "
                        f"resume with the same --workers, or {hint}")
    _main_counts(loader, main, asked, where, hint)
    _within(main["_base_seed"], 2**64 - 1, "_main_snapshot._base_seed", where, hint)  # torch.manual_seed's range
    for i in range(workers):
        worker = snap["_worker_snapshots"][f"worker_{i}"]
        if worker["worker_id"] != i:
            raise UserError(f"{where}: worker_{i} holds the state of worker {worker['worker_id']}; {hint}")
        if worker["dataset_state"] is not None:
            _check_stream(loader, worker["dataset_state"], i, where, hint)


def _main_counts(loader: ShardLoader, main: dict[str, Any], asked: int, where: str, hint: str) -> None:
    _within(main["_sampler_iter_yielded"], asked, "_sampler_iter_yielded", where, hint)
    _within(main["_sampler_iter_state"]["samples_yielded"], asked * loader.dataset.batch_size, "samples_yielded",
            where, hint)
    if main["_IterableDataset_len_called"] is not None:
        _within(main["_IterableDataset_len_called"], loader.dataset.num_samples, "_IterableDataset_len_called",
                where, hint)


def _check_stream(loader: ShardLoader, saved: dict[str, Any], worker: int, where: str, hint: str) -> None:
    """One worker's ShardStream state: this run's layout, a position inside its range, a skip list no longer."""
    d = loader.dataset
    workers = max(loader.loader.num_workers, 1)
    layout = [d.rank, d.world, workers, d.batch_size, d.num_samples]
    if saved["layout"] != layout:
        raise UserError(f"{where}: the data-loader state was made with rank, world, workers, batch size, samples "
                        f"= {saved['layout'][:5]}, this run has {layout}; resume with the same --workers, "
                        f"--batch-size, process count and data, or {hint}")
    lo, hi = worker_range(d.num_samples, d.rank, d.world, worker, workers, d.batch_size)
    _within(saved["pos"], hi - lo, f"worker {worker}'s pos", where, hint)
    _within(saved["epoch"], MAX_EPOCH, f"worker {worker}'s epoch", where, hint)
    _within(len(saved["skipped"]), saved["pos"], f"worker {worker}'s count of skipped samples", where, hint)
    if any(len(s) != 3 for s in saved["skipped"]):
        raise UserError(f"{where}: worker {worker}'s skipped samples must each be [shard, key, reason]; {hint}")


def _within(value: int, most: int, name: str, where: str, hint: str) -> None:
    if not 0 <= value <= most:
        raise UserError(f"{where}: {name} is {str(value)[:40]}, outside 0..{most} (what this loader can reach in "
                        f"an epoch), so it was damaged or crafted; {hint}")


def _collect_skipped(state: Any) -> list[list[str]]:
    if isinstance(state, dict):
        if "skipped" in state and "pos" in state:
            return list(state["skipped"])
        return [s for v in state.values() for s in _collect_skipped(v)]
    return []


def shard_loader(shardset: ShardSet, batch_size: int, workers: int, seed: int, rank: int = 0, world: int = 1,
                 transform: Transform | None = None, on_bad_file: str = "error", *, shuffle: bool = True,
                 block: int = 1000, channels: int | None = None, min_side: int | None = None,
                 max_pixels: int = image_files.MAX_PIXELS) -> ShardLoader:
    """A resumable streaming loader over `shardset` for one rank of `world` (use in place of a map-style loader).

    `shuffle=False` reads the samples in the order they were written (for validation, or to compare
    with an in-order folder run); `block` is how many samples' raw bytes a worker holds to shuffle.
    `min_side` and `max_pixels` decode as image files do (reduced big JPEGs, --max-pixels).
    """
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if on_bad_file not in ("error", "skip"):
        raise UserError(f"--on-bad-file must be 'error' or 'skip', got {on_bad_file!r}")
    dataset = ShardStream(shardset, batch_size=batch_size, seed=seed, rank=rank, world=world, transform=transform,
                          on_bad_file=on_bad_file, channels=channels, shuffle=shuffle, block=block,
                          min_side=min_side, max_pixels=max_pixels)
    return ShardLoader(dataset, workers)

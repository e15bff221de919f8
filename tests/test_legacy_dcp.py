"""Sharded checkpoints in torch's old pickle format (`.metadata`): refused unopened without
--unsafe-unpickle; with it, read through the restricted unpickler under its bounds, so that issue 30's
bombs (finding 3) are refused in well under 2 s as UserErrors and never crash the process; and an old
checkpoint of a real run still resumes and consolidates under the opt-in."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from bounds_check import Stopwatch
from torchcls.checkpoint import safe_dcp
from torchcls.checkpoint.consolidate import consolidate
from torchcls.checkpoint.files import CheckpointMeta
from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError
from torchcls.models.registry import ModelSpec, create_model

META = CheckpointMeta(ModelSpec("smallnet", 2, 3, 32), ["circle", "square"], Preprocess(32, 3, (0.5,) * 3, (0.5,) * 3),
                      {}, 1, 5)
# Offsets whose torch.Size hashes are all equal (so MetadataIndex("w", offset) keys collide): solved from
# CPython's tuple hash (xxHash rounds, invertible), each in [0, 2**48] like a real offset. Any number of
# them can be made this way, offline.
COLLIDING = [(0, 0), (29960, 110180963230777), (56220, 158640723273844), (62296, 255181683093318),
             (82480, 207100483316911), (108740, 255560243359978), (340565, 19053757997225),
             (370525, 129234721228002), (396785, 177694481271069), (423045, 226154241314136),
             (449305, 274614001357203), (681130, 38107515994450)]
REFUSAL_S = 2.0


def _old_format_run(base: Path) -> tuple[Path, dict]:
    """A run dir whose last.dcp is in the old format (FileSystemWriter: .metadata + .distcp), as a torchrun
    run wrote it before: the model, and the progress and rates as tensors."""
    torch.manual_seed(0)
    model = create_model(META.spec)
    state = {"model": model.state_dict(), "progress": torch.tensor([1, 5, 0]), "best_top1": torch.tensor(0.5,
             dtype=torch.float64), "lr": torch.tensor([0.01], dtype=torch.float64), "rng": torch.get_rng_state()}
    path = base / "run" / "checkpoints" / "last.dcp"
    dcp.save(state, checkpoint_id=str(path))
    (path / "meta.json").write_text(META.to_json())
    return base / "run", {k: v.clone() for k, v in state["model"].items()}


def _metadata(run: Path) -> Path:
    return run / "checkpoints" / "last.dcp" / ".metadata"


def _refusal(path: Path) -> tuple[float, str]:
    """Seconds until SafeReader refused the .metadata of `path`, and its message."""
    watch = Stopwatch()
    with pytest.raises(UserError) as refused:
        safe_dcp.SafeReader(str(path)).read_metadata()
    return watch.seconds(), str(refused.value)


def test_without_the_opt_in_not_a_byte_of_metadata_is_read(tmp_path: Path, monkeypatch) -> None:
    run, _ = _old_format_run(tmp_path)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    _metadata(run).write_bytes(pickle.dumps(Exploit()))
    monkeypatch.setattr(safe_dcp.SafeReader, "read_metadata", lambda *a, **k: pytest.fail(".metadata was read"))
    with pytest.raises(UserError, match=r"older pickle format.*means unpickling.*--unsafe-unpickle.*Nothing was read"):
        consolidate(run)
    assert not marker.exists()
    _metadata(run).unlink()
    os.mkfifo(_metadata(run))  # a FIFO would block a reader that opened it: it is never opened
    with pytest.raises(UserError, match="older pickle format"):
        consolidate(run)


def test_an_old_checkpoint_consolidates_and_resumes_under_the_opt_in(tmp_path: Path, monkeypatch) -> None:
    from torchcls.checkpoint import dcp as sharded

    run, weights = _old_format_run(tmp_path)
    merged = consolidate(run, tmp_path / "merged.safetensors", unsafe_unpickle=True)
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(merged)[k], v) for k, v in weights.items())
    model = create_model(META.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    from torchcls.checkpoint.checkpointer import Progress

    args = (run / "checkpoints" / "last.dcp", model, optimizer, scheduler, Progress(), META)
    with monkeypatch.context() as patch, pytest.raises(UserError, match="--unsafe-unpickle"):  # train --resume
        patch.setattr(safe_dcp.SafeReader, "read_metadata", lambda *a, **k: pytest.fail(".metadata was read"))
        sharded.load(*args)
    fields, _ = sharded.load(*args, unsafe_unpickle=True)
    assert fields == (1, 5, 0, 0.5, None) and optimizer.param_groups[0]["lr"] == 0.01
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_plain_data_entries_land_in_their_nested_places(tmp_path: Path) -> None:
    """Non-tensor entries are written as torch.save bytes and read back with weights_only; each is put back
    where the flattened state dict's path says, through dicts and lists."""
    saved = {"model": {"w": torch.arange(3.0)}, "n": 3,
             "extra": {"names": ["a", "b"], "groups": [{"lr": 0.1, "tag": "x"}, {"lr": 0.2, "tag": "y"}]}}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ckpt"))
    state = {"model": {"w": torch.zeros(3)}, "n": None,
             "extra": {"names": None, "groups": [{"lr": None, "tag": None}, {"lr": None, "tag": None}]}}
    safe_dcp.safe_load(state, tmp_path / "ckpt")
    assert torch.equal(state["model"]["w"], saved["model"]["w"])
    assert state["n"] == 3 and state["extra"] == saved["extra"]


@pytest.mark.parametrize("dims", [[2**62] * 100_000, [2**62] * 40, [2**62] * 16, [2**47] * 16],
                         ids=["100k-dims", "40-dims", "16-huge-dims", "16-dims-huge-product"])
def test_a_tensor_of_many_huge_dims_is_refused_before_any_product(tmp_path: Path, dims: list[int]) -> None:
    """Finding 3: N dims of 2**62 made check_layout's math.prod quadratic (700 KB: 17 s), then a raw ValueError."""
    run, _ = _old_format_run(tmp_path)
    md = safe_dcp.SafeReader(str(run / "checkpoints" / "last.dcp")).read_metadata()
    entry = md.state_dict_metadata["model.fc.weight"] if "model.fc.weight" in md.state_dict_metadata else next(
        e for k, e in md.state_dict_metadata.items() if k.startswith("model.") and hasattr(e, "chunks"))
    entry.size = torch.Size(dims)
    for chunk in entry.chunks:
        chunk.offsets, chunk.sizes = torch.Size([0] * len(dims)), torch.Size(dims)
    md.storage_meta = None
    _metadata(run).write_bytes(pickle.dumps(md, protocol=4))
    seconds, message = _refusal(run / "checkpoints" / "last.dcp")
    assert seconds < REFUSAL_S and ("over the bounds" in message or "elements" in message), message


def _dict_of(keys: list[bytes]) -> bytes:
    """A protocol-4 pickle of a dict with these (pickled) keys, each to None, in SETITEMS batches of 1000."""
    body = b"".join(b"(" + b"".join(k + b"N" for k in keys[i:i + 1000]) + b"u" for i in range(0, len(keys), 1000))
    return b"\x80\x04}" + body + b"."


def test_dict_keys_colliding_in_hash_are_refused_at_once(tmp_path: Path) -> None:
    """Finding 3: a dict of 150k int keys colliding in hash took 222 s (each insert compares them all)."""
    run, _ = _old_format_run(tmp_path)
    ints = [b"\x8a" + bytes([len(b)]) + b for b in (pickle.encode_long(i * (2**61 - 1)) for i in range(1, 150_001))]
    _metadata(run).write_bytes(_dict_of(ints))
    seconds, message = _refusal(run / "checkpoints" / "last.dcp")
    assert seconds < REFUSAL_S and ("a dict key of type int" in message or "an integer" in message), message
    _metadata(run).write_bytes(_dict_of(ints[:3]))  # the keys that fit in 8 bytes: refused as keys
    seconds, message = _refusal(run / "checkpoints" / "last.dcp")
    assert seconds < REFUSAL_S and "a dict key of type int" in message, message
    # The next way: keys DCP does use (MetadataIndex), with offsets crafted to collide in hash.
    if len({hash(torch.Size(o)) for o in COLLIDING}) != 1:
        pytest.skip("this Python's tuple hash differs from the one the offsets were solved for")
    md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w", torch.Size(o)): None for o in COLLIDING})
    _metadata(run).write_bytes(pickle.dumps(md, protocol=4))
    seconds, message = _refusal(run / "checkpoints" / "last.dcp")
    assert seconds < REFUSAL_S and "dict keys of one hash" in message, message


_DEEP = 2_000_000


def _nested_lists(depth: int) -> bytes:
    """L0 = [L1], L1 = [L2], ...: each new list appended to the one before, then fetched back from the memo."""
    ops = [b"]\x94j" + (0).to_bytes(4, "little")]  # L0 (memo 0), and L0 again on the stack
    ops += [b"]\x94a0j" + i.to_bytes(4, "little") for i in range(1, depth + 1)]
    return b"\x80\x04" + b"".join(ops) + b"0."
# Seconds as bounds_check.Stopwatch counts them: the lesser of wall-clock and CPU time.
_READ = ("import sys, time\nfrom torchcls.checkpoint.safe_dcp import SafeReader\nfrom torchcls.errors import UserError\n"
         "wall, cpu = time.perf_counter(), time.process_time()\ntry:\n    SafeReader(sys.argv[1]).read_metadata()\n"
         "except UserError as e:\n    print(min(time.perf_counter() - wall, time.process_time() - cpu))\n"
         "    print(e, file=sys.stderr)\n    sys.exit(e.exit_code)\n")


@pytest.mark.parametrize("payload", [
    b"\x80\x04}" + b"K\x01" + b"\x85" * _DEEP + b"Ns.",  # a 2M-deep tuple as a dict key
    b"\x80\x04(" + b"K\x01" + b"\x85" * _DEEP + b"\x91.",  # ... in a frozenset
    b"\x80\x04" + b"(" * _DEEP + b"K\x01" + b"t" * _DEEP + b".",  # 2M MARKs open
    _nested_lists(100_000),  # lists nested through the memo: the stack stays small, no tuple is made
], ids=["tuple-key", "tuple-in-frozenset", "marks", "memo-lists"])
def test_deep_nesting_never_crashes_the_process(tmp_path: Path, payload: bytes) -> None:
    """Finding 3: a 2M-deep tuple used as a dict key or in a frozenset killed `consolidate` with SIGSEGV
    (hashing a tuple recurses in C, with no limit). Each runs in a child process: a crash shows as -11."""
    run, _ = _old_format_run(tmp_path)
    _metadata(run).write_bytes(payload)
    done = subprocess.run([sys.executable, "-c", _READ, str(run / "checkpoints" / "last.dcp")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == UserError.exit_code, (done.returncode, done.stderr[-2000:])
    assert float(done.stdout) < REFUSAL_S and "Traceback" not in done.stderr


def test_plain_pickle_does_crash_on_the_deep_tuple(tmp_path: Path) -> None:
    """What the bound prevents is real: Python's own unpickler dies on the first payload above."""
    bomb = tmp_path / "bomb.pkl"
    bomb.write_bytes(b"\x80\x04}" + b"K\x01" + b"\x85" * _DEEP + b"Ns.")
    done = subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())",
                           str(bomb)], capture_output=True, timeout=120)
    if done.returncode == 0:
        pytest.skip("this machine's C stack held 2M frames")
    assert done.returncode < 0  # killed by a signal (SIGSEGV), not an exception


@pytest.mark.parametrize("payload,message", [
    (b"\x80\x04\x8f.", "a set"),  # EMPTY_SET: DCP metadata holds none
    (b"\x80\x04\x8a\x09" + b"\x01" * 9 + b".", "an integer"),  # LONG1 wider than 8 bytes
    (b"\x80\x04\x8b\x00\x00\x00\x10" + b"\x01" * 16 + b".", "LONG4"),
    (b"\x80\x04(" + b"K\x01" * 65 + b"t.", "a tuple of 65 items"),
])
def test_other_shapes_over_the_bounds_are_refused(tmp_path: Path, payload: bytes, message: str) -> None:
    run, _ = _old_format_run(tmp_path)
    _metadata(run).write_bytes(payload)
    seconds, said = _refusal(run / "checkpoints" / "last.dcp")
    assert message in said and seconds < REFUSAL_S


def test_a_metadata_over_its_size_bound_is_not_read(tmp_path: Path, monkeypatch) -> None:
    from torchcls.checkpoint import dcp_metadata

    run, _ = _old_format_run(tmp_path)
    monkeypatch.setattr(dcp_metadata, "MAX_METADATA_BYTES", _metadata(run).stat().st_size - 1)
    with pytest.raises(UserError, match=r"\.metadata.*at most \d+ bytes"):
        safe_dcp.SafeReader(str(run / "checkpoints" / "last.dcp")).read_metadata()


def _one_tensor_metadata(size: list[int], chunks: list[tuple[list[int], list[int]]], spans: list[tuple[int, int]]):
    """Metadata of one float64 tensor 'epoch_sums' of `size`, its chunks (offsets, sizes) stored at `spans` of d.distcp."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    listed = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]
    storage = {MetadataIndex("epoch_sums", torch.Size(o)): _StorageInfo("d.distcp", off, n)
               for (o, _), (off, n) in zip(chunks, spans)}
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float64), torch.Size(size), listed)
    return Metadata(state_dict_metadata={"epoch_sums": entry}, storage_data=storage)


@pytest.mark.parametrize("size, chunks, spans, message", [
    # the review's reproducer, small: one 64-byte chunk listed 1,000 times "covered" 8,000 elements
    ([8 * 1000], [([0], [8])] * 1000, [(0, 64)], "more than once"),
    # chunks [0:6] and [4:10] of 10 elements add up to 12 >= 10 and leave nothing out by count
    ([10], [([0], [6]), ([4], [6])], [(0, 48), (48, 48)], "overlaps"),
    # 2-D: two 2x2 chunks at distinct offsets overlapping in one cell, a gap elsewhere
    ([3, 3], [([0, 0], [2, 2]), ([1, 1], [2, 2]), ([0, 2], [1, 1]), ([2, 0], [1, 1])],
     [(0, 32), (32, 32), (64, 8), (72, 8)], "overlaps"),
    # distinct chunks, each its size in bytes, but all claiming the same bytes of the file
    ([4 * 8], [([i * 8], [8]) for i in range(4)], [(0, 64)] * 4, "same bytes"),
    # a tensor bigger than its chunks reach
    ([20], [([0], [10])], [(0, 80)], "not covered"),
], ids=["repeated-chunk", "overlap-1d", "overlap-2d", "shared-bytes", "short"])
def test_chunks_must_tile_their_tensor_exactly_in_bytes_of_their_own(tmp_path: Path, size, chunks, spans,
                                                                      message) -> None:
    """Review 3, finding 1: `covered` summed each chunk's elements, so a repeated chunk made an 8 KiB file
    pass as a 1.02e9-element epoch_sums (legacy_dcp allocates torch.zeros of it). The chunks must now tile
    the tensor exactly (hf_dcp.check_cover) and no two entries may share stored bytes."""
    from torchcls.checkpoint.dcp_metadata import check_layout

    (tmp_path / "d.distcp").write_bytes(b"\0" * 128)
    with pytest.raises(UserError, match=message):
        check_layout(_one_tensor_metadata(size, chunks, spans), tmp_path)


def test_an_exact_tiling_in_distinct_bytes_passes(tmp_path: Path) -> None:
    from torchcls.checkpoint.dcp_metadata import check_layout

    (tmp_path / "d.distcp").write_bytes(b"\0" * 128)
    grid = [([r, c], [2, 2]) for r in (0, 2) for c in (0, 2)]  # a 4x4 tensor in four 2x2 chunks (a 2-D mesh)
    check_layout(_one_tensor_metadata([4, 4], grid, [(i * 32, 32) for i in range(4)]), tmp_path)
    check_layout(_one_tensor_metadata([0, 4], [], []), tmp_path)  # an empty tensor needs no chunk

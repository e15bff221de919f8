"""WebDataset shards: writing (same samples and bytes as the source, index, atomic), streaming
(each sample once per epoch over ranks x workers, exact mid-epoch resume), and bad shards."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from torchvision.transforms import v2

from conftest import make_image_folder
from torchcls.data.shards import (
    INDEX,
    Shard,
    ShardSet,
    describe,
    is_shard_source,
    open_shards,
    parse_size,
    split_shards,
    verify_shards,
    write_shards,
)
from torchcls.data.sources import ImageSet, open_source
from torchcls.data.streaming import shard_loader
from torchcls.errors import UserError


def numbered_set(n: int = 300, side: int = 8) -> ImageSet:
    """An in-memory set whose image i carries i in its first two pixels, so a batch says which samples it holds."""
    images = torch.zeros(n, side, side, dtype=torch.uint8)
    ids = torch.arange(n)
    images[:, 0, 0], images[:, 0, 1] = (ids % 256).to(torch.uint8), (ids // 256).to(torch.uint8)
    return ImageSet("numbered", [str(c) for c in range(3)], ids % 3, 1, images=images)


def ids_of(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    images = batch[0]
    return (images[:, 0, 0, 0].long() + 256 * images[:, 0, 0, 1].long()).tolist()


@pytest.fixture
def numbered_shards(tmp_path: Path):
    return write_shards(numbered_set(), tmp_path / "shards", shard_size_bytes=20_000)


def test_folder_round_trip_keeps_samples_labels_and_bytes(tmp_path: Path):
    folder = make_image_folder(tmp_path / "shapes", per_class=6)
    shardset = write_shards(str(folder), tmp_path / "shards", shard_size_bytes=8_000)
    index = json.loads((tmp_path / "shards" / INDEX).read_text())
    assert len(shardset.shards) > 1 and index["num_samples"] == 12 == len(shardset)
    assert index["classes"] == ["circle", "square"] and index["class_counts"] == [6, 6]
    assert sum(s["samples"] for s in index["shards"]) == 12
    found, keys = Counter(), []
    for entry in index["shards"]:
        path = tmp_path / "shards" / entry["name"]
        assert entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        with tarfile.open(path) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        for name, data in members.items():
            if name.endswith(".png"):
                key = name[:-4]
                keys.append(key)
                found[(index["classes"][int(members[key + ".cls"])], hashlib.sha256(data).hexdigest())] += 1
    source = open_source(str(folder), None, "train", None, "error")
    expected = Counter((source.classes[int(t)], hashlib.sha256(Path(p).read_bytes()).hexdigest())
                       for p, t in zip(source.paths, source.targets))
    assert found == expected and len(set(keys)) == 12  # the files themselves, no re-encode, unique keys
    assert is_shard_source(str(tmp_path / "shards")) and not is_shard_source(str(folder))
    assert verify_shards(shardset).keys() == {s["name"] for s in index["shards"]}


def test_in_memory_set_becomes_png_and_decodes_back(numbered_shards):
    loader = shard_loader(numbered_shards, 50, 0, seed=0, shuffle=False)
    got = torch.cat([b[0] for b in loader])
    order = ids_of((got, None))
    assert sorted(order) == list(range(300))
    original = numbered_set()
    assert torch.equal(got[:, 0], original.images[order])
    assert numbered_shards.channels == 1 and numbered_shards.side == 8 and numbered_shards.source == "numbered"


def test_write_is_atomic_and_refuses_a_full_folder(tmp_path: Path):
    folder = make_image_folder(tmp_path / "shapes", per_class=3)
    images = open_source(str(folder), None, "train", None, "error")
    images.paths[-1].unlink()  # gone after the scan: the writer fails half-way
    with pytest.raises(UserError, match="square_002.png: file not found; no shards were written"):
        write_shards(images, tmp_path / "out", shard_size_bytes=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"]  # no out/, no partial folder
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UserError, match="already exists and is not empty"):
        write_shards(numbered_set(), tmp_path / "full")


def test_brace_pattern_and_folder_without_index(numbered_shards, tmp_path: Path):
    root = Path(numbered_shards.shards[0].path).parent
    first_two = open_shards(str(root / "train-{000000..000001}.tar"))
    assert [s.path.name for s in first_two.shards] == ["train-000000.tar", "train-000001.tar"]
    assert len(first_two) == numbered_shards.shards[0].samples + numbered_shards.shards[1].samples
    (root / INDEX).unlink()
    scanned = open_shards(str(root))
    assert len(scanned) == 300 and scanned.classes == ["0", "1", "2"] and scanned.index is None



@pytest.mark.parametrize("pattern", ["a-{000..009}.tar", "x{a,b,{c,d}}y{1..3}", "s{1..10..2}", "{9..0}", "{a..e..2}",
                                     "{{1..400},{1..400}}", "{abc}", "{a,b{1..3}c,d}", "x\\{1..9\\}", "plain.tar"])
def test_a_brace_pattern_is_counted_as_braceexpand_expands_it(pattern: str):
    from braceexpand import braceexpand

    from torchcls.data.shards import brace_names_bound

    assert brace_names_bound(pattern) == sum(1 for _ in braceexpand(pattern))


@pytest.mark.parametrize("pattern", ["train-{0..999999999}.tar", "{a..z}{a..z}{a..z}{a..z}",
                                     "{{1..400},{1..400}}{1..400}"])
def test_a_pattern_naming_too_many_shards_is_refused_before_it_is_expanded(pattern: str, tmp_path: Path):
    # braceexpand builds a range in full before its first name: 10^9 strings for the first
    with pytest.raises(UserError, match="may name more than 100,000 shard files"):
        open_shards(str(tmp_path / pattern))

def epoch_ids(shardset, rank: int, world: int, workers: int, epoch: int) -> list[list[int]]:
    loader = shard_loader(shardset, 16, workers, seed=3, rank=rank, world=world)
    loader.set_epoch(epoch)
    batches = [ids_of(b) for b in loader]
    assert len(batches) == len(loader)
    return batches


def test_two_ranks_two_workers_see_each_sample_once_per_epoch(numbered_shards):
    orders = []
    for epoch in (0, 1):
        per_rank = [epoch_ids(numbered_shards, rank, 2, 2, epoch) for rank in (0, 1)]
        seen = [i for batches in per_rank for b in batches for i in b]
        assert sorted(seen) == list(range(300))  # every sample exactly once across ranks and workers
        assert len(per_rank[0]) == len(per_rank[1])  # the same number of steps on every rank
        orders.append(seen)
    assert orders[0] != orders[1]  # a new order each epoch ...
    assert epoch_ids(numbered_shards, 1, 2, 2, 1) == epoch_ids(numbered_shards, 1, 2, 2, 1)  # ... and seeded


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_gives_the_uninterrupted_batches(numbered_shards, workers: int):
    augment = v2.Compose([v2.RandomCrop(8, padding=2), v2.RandomHorizontalFlip()])

    def loader():
        ld = shard_loader(numbered_shards, 16, workers, seed=5, rank=1, world=2, transform=augment, block=40)
        ld.set_epoch(2)
        return ld

    reference = list(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # plain data: any checkpoint format can hold it
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head) + len(tail) == len(reference)
    for got, want in zip(head + tail, reference):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_resume_decodes_only_what_is_left(numbered_shards):
    decoded = []

    def counting(image: torch.Tensor) -> torch.Tensor:
        decoded.append(1)
        return image

    first = shard_loader(numbered_shards, 10, 0, seed=1, transform=counting, block=64)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    decoded.clear()
    resumed = shard_loader(numbered_shards, 10, 0, seed=1, transform=counting, block=64)
    resumed.load_state_dict(state)
    assert sum(len(b[1]) for b in resumed) == 300 - 70 == len(decoded)


def write_tar(path: Path, samples: list[tuple[str, bytes, bytes]]) -> None:
    from webdataset import TarWriter
    with TarWriter(str(path), encoder=False) as w:
        for key, image, label in samples:
            w.write({"__key__": key, "png": image, "cls": label})


@pytest.fixture
def shard_with_bad_sample(tmp_path: Path, numbered_shards) -> Path:
    """One hand-made shard: good PNGs from the numbered set, a truncated PNG and a sample without a label."""
    good = []
    with tarfile.open(numbered_shards.shards[0].path) as tf:
        for m in tf.getmembers():
            if m.name.endswith(".png"):
                good.append(tf.extractfile(m).read())
    folder = tmp_path / "bad"
    folder.mkdir()
    samples = [(f"s{i:03d}", data, str(i % 3).encode()) for i, data in enumerate(good[:6])]
    samples.insert(2, ("broken", good[0][: len(good[0]) // 2], b"1"))
    write_tar(folder / "part-0.tar", samples)
    return folder


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_sample_error_names_shard_and_key(shard_with_bad_sample: Path, workers: int):
    shardset = open_shards(str(shard_with_bad_sample))
    with pytest.raises(UserError) as err:
        list(shard_loader(shardset, 4, workers, seed=0, on_bad_file="error"))
    message = str(err.value)
    assert "part-0.tar" in message and "broken" in message and "--on-bad-file skip" in message
    assert "Traceback" not in message


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_sample_skip_leaves_it_out_and_lists_it(shard_with_bad_sample: Path, workers: int):
    shardset = open_shards(str(shard_with_bad_sample))
    loader = shard_loader(shardset, 4, workers, seed=0, on_bad_file="skip")
    assert sum(len(b[1]) for b in loader) == 6
    assert [(Path(s).name, k) for s, k, _ in loader.skipped] == [("part-0.tar", "broken")]


def test_truncated_and_empty_shards_are_named(numbered_shards, tmp_path: Path):
    shard = numbered_shards.shards[1].path
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=f"shard {shard} has .* bytes but .* records"):
        open_shards(str(shard.parent))
    (shard.parent / INDEX).unlink()  # without an index the tar itself shows the cut
    with pytest.raises(UserError, match=f"shard {shard}.*truncated"):
        open_shards(str(shard.parent))
    shard.write_bytes(b"")
    with pytest.raises(UserError, match=f"shard {shard} is empty"):
        open_shards(str(shard.parent))


def test_hashes_that_disagree_with_the_index_are_named(numbered_shards):
    shard = numbered_shards.shards[2].path
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    open_shards(str(shard.parent))  # sizes agree: only a verification reads the bytes
    with pytest.raises(UserError, match=f"1 shard.* disagree.*\n  {shard}: sha256"):
        open_shards(str(shard.parent), verify=True)


RANK_SCRIPT = """
import json, os, sys
from torchcls.data.shards import open_shards
from torchcls.data.streaming import shard_loader
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
loader = shard_loader(open_shards(sys.argv[1]), 16, 1, seed=7, rank=rank, world=world)
loader.set_epoch(1)
ids = [int(x) + 256 * int(y) for images, _ in loader for x, y in images[:, 0, 0, :2].tolist()]
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"ids": ids, "steps": len(loader)}, f)
"""


@pytest.mark.slow
def test_torchrun_two_ranks_cover_the_epoch_once(numbered_shards, tmp_path: Path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    root = str(Path(numbered_shards.shards[0].path).parent)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", "0", str(script), root, str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(ranks[0]["ids"] + ranks[1]["ids"]) == list(range(300))
    assert ranks[0]["steps"] == ranks[1]["steps"]


def test_index_counts_that_disagree_with_a_shard_are_named(numbered_shards):
    index_path = Path(numbered_shards.index)
    index = json.loads(index_path.read_text())
    index["shards"][0]["samples"] += 1  # a stale or hand-edited index: sizes still agree
    index["class_counts"][0] += 1  # ... and its counts with each other (else it is refused when opened)
    index_path.write_text(json.dumps(index))
    shard = numbered_shards.shards[0].path
    with pytest.raises(UserError, match=f"shard {shard} does not hold the .* samples its index records"):
        list(shard_loader(open_shards(str(index_path.parent)), 16, 0, seed=0, shuffle=False))


def test_shard_size_text():
    assert parse_size("1GB") == 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("2000") == 2000
    with pytest.raises(UserError, match="--shard-size"):
        parse_size("lots")


def test_val_fraction_holds_out_whole_shards(numbered_shards):
    train, val = split_shards(numbered_shards, 0.25, seed=1)
    assert len(train) + len(val) == 300 and len(val.shards) == round(len(numbered_shards.shards) * 0.25)
    assert {s.path for s in train.shards}.isdisjoint(s.path for s in val.shards)
    assert split_shards(numbered_shards, 0.25, seed=1)[1].shards == val.shards  # seeded
    facts = describe(numbered_shards)
    assert facts["num_samples"] == 300 and len(facts["index_sha256"]) == 64
    assert [s["sha256"] for s in facts["shards"]] == [s.sha256 for s in numbered_shards.shards]


# --- tar headers are checked before tarfile parses them (review: a pax header of 32 KiB of digits took 1 s in
# tarfile's regex, CVE-2024-6232, quadratic; a GNU long name declaring 2^40 bytes made tarfile read(2^40), a
# MemoryError) -------------------------------------------------------------------------------------------------

def tar_header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(tarfile.GNU_FORMAT if size >= 8**11 else tarfile.USTAR_FORMAT)  # (GNU: base-256 sizes)


def tar_member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    return tar_header(name, len(data), kind) + data + bytes(-len(data) % 512)


def negative_size_header(name: str) -> bytes:
    """A header whose size field is GNU base-256 for -5 (as tarfile reads it), its checksum recomputed."""
    header = bytearray(tar_header(name, 0))
    header[124:136], header[148:156] = b"\xff" * 11 + b"\xfb", b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def pax(*records: tuple[str, str], kind: bytes = tarfile.XHDTYPE) -> bytes:
    """A pax header ('x' or 'g') holding these records, each "LEN KEY=VALUE\\n" as tarfile writes them."""
    data = b""
    for key, value in records:
        body = f" {key}={value}\n".encode()
        n = len(body) + len(str(len(body)))
        n += len(str(n)) - len(str(len(body)))
        data += str(n).encode() + body
    return tar_member("././@PaxHeader", data, kind)


def png_member_bytes() -> bytes:
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("L", (8, 8), 90).save(buf, "PNG")
    return buf.getvalue()


def sample(key: str, label: int) -> bytes:
    return tar_member(f"{key}.png", png_member_bytes()) + tar_member(f"{key}.cls", str(label).encode())


def shard_of(folder: Path, *parts: bytes) -> Path:
    folder.mkdir()
    (folder / "a.tar").write_bytes(b"".join(parts) + bytes(1024))
    return folder / "a.tar"


def test_tar_extension_headers_are_bounded_before_tarfile_parses_them(tmp_path: Path):
    from torchcls.data.tar_headers import MAX_TAR_EXTENSION_BYTES
    good = sample("s0", 0) + sample("s1", 1)
    cases = {  # name: (the bad header chain, what the error says)
        "digits": (tar_member("././@PaxHeader", b"1" * (MAX_TAR_EXTENSION_BYTES + 1), tarfile.XHDTYPE),
                   "pax extended header \\('x'\\) of 65,537 bytes, more than the 65,536 read"),
        "digits_within": (tar_member("././@PaxHeader", b"1" * (32 << 10), tarfile.XHDTYPE),
                          "a malformed record at byte 0"),
        "digit_run": (pax(("path", "9" * 33 + ".png")), "a run of more than 32 digits"),
        "split_pax": (b"".join(pax(("comment", "1" * 30 + "x")) for _ in range(9)),
                      "more than 8 extension headers in a row"),
        "long_name_2_40": (tar_header("././@LongLink", 1 << 40, tarfile.GNUTYPE_LONGNAME) + bytes(512),
                           "\\(member '././@LongLink'\\) declares 1,099,511,627,776 bytes, past the end"),
        "long_name_big": (tar_member("././@LongLink", b"n" * (MAX_TAR_EXTENSION_BYTES + 1), tarfile.GNUTYPE_LONGNAME),
                          "GNU long-name header \\('L'\\) of 65,537 bytes"),
        "sparse": (tar_member("s2.png", b"x", tarfile.GNUTYPE_SPARSE), "GNU sparse member \\('S'\\)"),
        "pax_sparse": (pax(("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0")), "GNU sparse keys"),
        "records": (pax(*((f"k{i}", "v") for i in range(33))), "more than 32 records"),
        "padding": (tar_member("././@PaxHeader", b"5 a=b\n", tarfile.XHDTYPE)[:-6] + b"1 a=b\n",
                    "data in its padding"),
        "global_later": (pax(("comment", "x"), kind=tarfile.XGLTYPE), "pax global header \\('g'\\) after the first"),
        "member_past_end": (tar_header("s2.png", 1 << 30), "\\(member 's2.png'\\) declares 1,073,741,824 bytes"),
        "negative_size": (negative_size_header("s2.png"), "\\(member 's2.png'\\) declares -5 bytes, a negative size"),
    }
    for name, (chain, reason) in cases.items():
        for where, parts in (("first", (chain, good)), ("after a sample", (good, chain, sample("s2", 0)))):
            if name == "global_later" and where == "first":
                continue  # (allowed first: git archive writes one)
            shard = shard_of(tmp_path / f"{name}-{where.split()[0]}", *parts)
            at = 0 if where == "first" else len(good)
            where = f"shard {re.escape(str(shard))}: the tar header at byte {at:,} "
            with pytest.raises(UserError, match=f"{where}.*{reason}"):
                open_shards(str(shard.parent))


def test_tar_headers_of_real_writers_still_open_and_stream(tmp_path: Path):
    import io
    png = png_member_bytes()
    (tmp_path / "wds").mkdir()  # webdataset's default: a float mtime, so a pax header before every member
    write_tar(tmp_path / "wds" / "a.tar", [(f"{'k' * 120}/é{i:03d}", png, str(i % 2).encode()) for i in range(4)])
    assert (tmp_path / "wds" / "a.tar").read_bytes().count(b" mtime=") >= 8
    for fmt, extra in ((tarfile.GNU_FORMAT, None), (tarfile.PAX_FORMAT, {"comment": "made by tarfile"})):
        folder = tmp_path / f"fmt{fmt}"
        folder.mkdir()
        with tarfile.open(folder / "a.tar", "w", format=fmt, pax_headers=extra) as tf:  # long names: 'L' or 'x'
            for i in range(4):
                for ext, data in (("png", png), ("cls", str(i % 2).encode())):
                    info = tarfile.TarInfo(f"{'d' * 120}/{i:03d}.{ext}")
                    info.size, info.mtime = len(data), 1.7e9 + 0.25
                    tf.addfile(info, io.BytesIO(data))
    for folder in ("wds", f"fmt{tarfile.GNU_FORMAT}", f"fmt{tarfile.PAX_FORMAT}"):
        shardset = open_shards(str(tmp_path / folder))
        labels = [int(y) for _, ys in shard_loader(shardset, 2, 0, seed=0, shuffle=False) for y in ys]
        assert len(shardset) == 4 and labels == [0, 1, 0, 1], folder


# --- a pax 'size' record replaces the member's header size, and tarfile moves its offset by it (second review:
# size=-1536 sent tarfile back to the same header, so iter_members parsed one member forever while TarFile.members
# grew; size=-1 passed the 256 MiB bound and f.read(-1) read the rest of the shard) --------------------------------

@pytest.mark.timeout(120)  # (a refusal, never a hang: it looped before)
def test_a_pax_size_record_is_held_to_the_header_size_checks(tmp_path: Path):
    good = sample("s0", 0) + sample("s1", 1)
    cases = {  # name: (the pax header before the next member, what the error says)
        "negative": (pax(("size", "-1536")), "with a 'size' record of '-1536', not a non-negative decimal of at most 20"),
        "minus_one": (pax(("size", "-1")), "a 'size' record of '-1'"),
        "plus": (pax(("size", "+5")), "a 'size' record of '\\+5'"),  # (int() takes these; a tar writer never)
        "underscore": (pax(("size", "1_0")), "a 'size' record of '1_0'"),
        "space": (pax(("size", " 5")), "a 'size' record of ' 5'"),
        "empty": (pax(("size", "")), "a 'size' record of ''"),
        "digits": (pax(("size", "1" * 21)), "a 'size' record of '1{21}'"),
        "second_record": (pax(("path", "s9.png"), ("size", "-1536")), "a 'size' record of '-1536'"),
        "past_end": (pax(("size", "999999")), "pax extended header \\('x'\\) whose 'size' record gives member "
                                              "'s[02].png' \\(at byte [0-9,]+\\) 999,999 bytes, past the end of the"),
        "global_first": (pax(("size", "4"), kind=tarfile.XGLTYPE), "pax global header \\('g'\\) with a 'size' record"),
    }
    for name, (chain, reason) in cases.items():
        for where, parts in (("first", (chain, good)), ("after a sample", (good, chain, sample("s2", 0)))):
            if name == "global_first" and where != "first":
                continue  # (a global header after the first member is refused as such)
            shard = shard_of(tmp_path / f"{name}-{where.split()[0]}", *parts)
            at = 0 if where == "first" else len(good)
            with pytest.raises(UserError, match=f"shard {re.escape(str(shard))}: the tar header at byte {at:,} .*{reason}"):
                open_shards(str(shard.parent))
            if where == "first":
                continue
            shardset = ShardSet("x", ["0", "1"], [Shard(shard, 3, shard.stat().st_size, None)])
            with pytest.raises(UserError, match=reason):  # the streaming reader checks each header chain too
                list(shard_loader(shardset, 2, 0, seed=0, shuffle=False))


@pytest.mark.timeout(120)
def test_members_that_do_not_move_forward_are_refused_even_past_the_header_check(tmp_path: Path, monkeypatch):
    """iter_members' own check, with check_member_headers switched off: a negative size, or a member that does not
    lie after the one before, ends the read with an error (it re-parsed the same member forever)."""
    from torchcls.data import shards
    from torchcls.data.streaming import _read_span, _sample_spans
    monkeypatch.setattr(shards, "check_member_headers", lambda *args: None)
    for size in ("-1536", "-1"):
        shard = shard_of(tmp_path / size, sample("s0", 0), pax(("size", size)), sample("s1", 1))
        with pytest.raises(UserError, match=f"member 's1.png' has a size of {int(size):,} bytes"):
            open_shards(str(shard.parent))
    member = tarfile.TarInfo("s0.cls")
    member.size, member.offset_data = -1, 512
    assert _sample_spans({"cls": member}) == {"cls": None}  # (never read: read(-1) is the rest of the file)
    with pytest.raises(UserError, match="negative size"):
        _read_span(io.BytesIO(b"x" * 4096), (512, -1, "s0.cls"), "a.tar")


def test_a_well_formed_pax_size_record_still_reads(tmp_path: Path):
    """A pax 'size' (tarfile writes one for a member over 8 GiB, with 0 in the header) that fits the file is used."""
    png = png_member_bytes()
    member = tar_header("s0.png", 0) + png + bytes(-len(png) % 512)
    shard = shard_of(tmp_path / "ok", pax(("size", str(len(png)))), member, tar_member("s0.cls", b"1"), sample("s1", 0))
    shardset = open_shards(str(shard.parent))
    labels = [int(y) for _, ys in shard_loader(shardset, 2, 0, seed=0, shuffle=False) for y in ys]
    assert len(shardset) == 2 and labels == [1, 0]


# --- a brace pattern's names each carry the pattern's text (second review: a 250 KB pattern naming 100,000 files
# was ~23 GiB of names): names x pattern length is bounded before braceexpand runs -------------------------------

def test_a_pattern_whose_names_would_be_too_many_characters_is_refused_before_it_is_expanded(tmp_path: Path,
                                                                                               monkeypatch):
    from torchcls.data import shards
    long = str(tmp_path / ("d" * 250_000 + "-{00000..99999}.tar"))  # (~25 GB of names)
    with pytest.raises(UserError, match="may name 100,000 shard files of up to 250,[0-9]{3} characters each, more "
                                        "than 67,108,864 characters in all \\(shards.MAX_PATTERN_CHARS\\)") as e:
        open_shards(long)
    assert len(str(e.value)) < 1_000  # (the pattern is shortened in the message)
    monkeypatch.setattr(shards, "MAX_PATTERN_CHARS", 1_000)  # the bound is names x length, not names alone
    for i in range(3):
        tar_with_one_sample = shard_of(tmp_path / f"f{i}", sample("s0", i % 2))
        tar_with_one_sample.rename(tmp_path / f"t-{i}.tar")
    assert len(open_shards(str(tmp_path / "t-{0..2}.tar"))) == 3
    with pytest.raises(UserError, match="may name 1,000 shard files of up to"):
        open_shards(str(tmp_path / "t-{000..999}.tar"))


def test_a_shuffle_block_holds_at_most_max_block_bytes(numbered_shards, monkeypatch):
    """Past MAX_BLOCK_BYTES a block's samples stay in their shard until used: the same batches, and the same resume."""
    from torchcls.data import streaming

    def run(**kw) -> list[list[int]]:
        ld = shard_loader(numbered_shards, 16, 0, seed=3, block=100, **kw)
        ld.set_epoch(1)
        return [ids_of(b) for b in ld]

    reference = run()
    monkeypatch.setattr(streaming, "MAX_BLOCK_BYTES", 2_000)
    stream = shard_loader(numbered_shards, 16, 0, seed=3, block=100).dataset
    budget = [streaming.MAX_BLOCK_BYTES]
    block = list(itertools.islice(stream._read(0, 300, budget), 100))
    held = [f for _, _, f in block if isinstance(f, dict)]
    assert sum(len(v) for f in held for v in f.values() if v) <= 2_000 and 0 < len(held) < 100
    assert run() == reference
    first = shard_loader(numbered_shards, 16, 0, seed=3, block=100)
    first.set_epoch(1)
    it = iter(first)
    head = [ids_of(next(it)) for _ in range(9)]
    resumed = shard_loader(numbered_shards, 16, 0, seed=3, block=100)
    resumed.load_state_dict(first.state_dict())
    assert head + [ids_of(b) for b in resumed] == reference

"""Property tests of the sharded checkpoint's readers (hypothesis): whatever a safetensors header, a
shard's DCP offsets or state.json holds — valid files with one thing changed, huge and negative dims,
many dims, unknown dtypes, byte ranges off by some, junk JSON, nesting thousands deep — the reader
either loads it or refuses it with a UserError, quickly and within a bounded memory."""

from __future__ import annotations

import json
import math
import resource
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchcls.checkpoint import hf_dcp, sharded_state
from torchcls.checkpoint.safetensors_bounds import DTYPE_BYTES, check_safetensors_header
from torchcls.errors import UserError

TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "F16": torch.float16,
                "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "I64": torch.int64,
                "F64": torch.float64}
SETTINGS = settings(max_examples=120, deadline=3000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])
RSS_GROWTH_MB = 400  # the peak RSS of the whole property run may grow by at most this much

names = st.text("abcxyz.0123", min_size=1, max_size=12)
small_shapes = st.lists(st.integers(0, 4), max_size=3)
json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=6))
junk = st.recursive(json_leaves, lambda c: st.one_of(st.lists(c, max_size=3),
                                                     st.dictionaries(st.text(max_size=4), c, max_size=3)), max_leaves=12)
weird_dims = st.one_of(st.integers(0, 4), st.integers(2**40, 2**70), st.integers(-2**64, -1), json_leaves)


def _valid(tensors: list[tuple[str, str, list[int]]]) -> tuple[dict, int]:
    """A header as DCP's safetensors writer makes one, and its data's length."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    info = {name: {"saved_offsets": [0] * len(shape)} for name, _, shape in tensors}
    header["__metadata__"] = {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"}
    return header, offset


@st.composite
def headers(draw) -> tuple[bytes, int, int | None]:
    """(header text, data length, a header-length prefix other than the text's, or None)."""
    tensors = draw(st.dictionaries(names, st.tuples(st.sampled_from(sorted(TORCH_DTYPES)), small_shapes),
                                   min_size=1, max_size=5))
    header, data = _valid([(k, d, s) for k, (d, s) in tensors.items()])
    name = draw(st.sampled_from(sorted(tensors)))
    change = draw(st.sampled_from(["none", "dim", "many-dims", "dtype", "offsets", "entry", "metadata", "sharding",
                                   "deep-metadata", "deep-sharding", "data", "prefix", "text"]))
    prefix = None
    if change == "dim":
        header[name]["shape"] = header[name]["shape"] + [draw(weird_dims)]
    elif change == "many-dims":
        header[name]["shape"] = [draw(st.sampled_from([0, 1, 2**62]))] * draw(st.integers(9, 5000))
    elif change == "dtype":
        header[name]["dtype"] = draw(st.one_of(st.sampled_from(["F4", "F8_E8M0", "C64", "", "f32"]), junk))
    elif change == "offsets":
        header[name]["data_offsets"] = draw(st.lists(st.one_of(st.integers(-9, data + 9), weird_dims), max_size=3))
    elif change == "entry":
        header[draw(names)] = draw(junk)
    elif change == "metadata":
        header["__metadata__"] = draw(junk)
    elif change == "sharding":
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(draw(junk))
    elif change == "deep-metadata":  # raw nesting, spliced into the text below
        header["__metadata__"]["deep"] = "@@DEEP@@"
    elif change == "deep-sharding":
        header["__metadata__"]["DCP_SHARDING_INFO"] = "[" * draw(st.integers(500, 100_000))
    elif change == "data":
        data += draw(st.integers(-8, 8))
    elif change == "prefix":
        prefix = draw(st.one_of(st.integers(0, 64), st.integers(2**20, 2**64 - 1)))
    text = json.dumps(header).encode()
    if change == "deep-metadata":
        depth = draw(st.integers(500, 100_000))
        text = text.replace(b'"@@DEEP@@"', b"[" * depth + b"]" * depth)
    elif change == "text":
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.binary(max_size=8)) + text[cut:]
    return text, max(data, 0), prefix


def _write(path: Path, text: bytes, data: int, prefix: int | None) -> Path:
    path.write_bytes(struct.pack("<Q", len(text) if prefix is None else prefix) + text + b"\x07" * data)
    return path


@pytest.fixture(scope="module")
def rss_bound():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < RSS_GROWTH_MB, f"peak RSS grew by {grown_mb:.0f} MB over the property tests"


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, None, 4, True])
def test_a_dtype_of_another_json_type_is_refused(tmp_path: Path, dtype) -> None:
    header, data = _valid([("w", "F32", [1])])
    header["w"]["dtype"] = dtype  # a list or an object is unhashable: it was a TypeError from the dtype lookup
    with pytest.raises(UserError, match="is not a safetensors entry"):
        check_safetensors_header(_write(tmp_path / "w.safetensors", json.dumps(header).encode(), data, None))


@SETTINGS
@given(headers())
def test_a_safetensors_header_loads_or_is_refused(tmp_path: Path, rss_bound, case) -> None:
    from safetensors import safe_open

    path = _write(tmp_path / "w.safetensors", *case)
    try:
        header = check_safetensors_header(path)
    except UserError:
        return
    with safe_open(str(path), framework="pt") as f:  # what passed the check, the library reads in full
        for name in f.keys():
            assert list(f.get_tensor(name).shape) == header[name]["shape"]


@SETTINGS
@given(st.lists(headers(), min_size=1, max_size=2))
def test_a_sharded_dir_loads_or_is_refused(tmp_path: Path, rss_bound, shards) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir(exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    for rank, case in enumerate(shards, 1):
        _write(directory / f"shard-{rank:05d}-model-00001-of-00001.safetensors", *case)
    try:
        saved = hf_dcp.check_dir(directory)
    except UserError:
        return
    target = {k: torch.zeros(s.size, dtype=TORCH_DTYPES[s.dtype]) for k, s in saved.items()}
    try:
        hf_dcp.load(target, directory)
    except UserError:
        pass  # e.g. the same name written by both files with different content: refused, not a crash


states = st.one_of(junk, st.fixed_dictionaries({
    "format": st.sampled_from([sharded_state.FORMAT, "x"]), "epoch": st.one_of(st.integers(0, 9), weird_dims),
    "step": st.one_of(st.integers(0, 9), weird_dims), "step_in_epoch": st.integers(-1, 3),
    "best_top1": st.one_of(st.floats(), json_leaves), "lr": st.one_of(st.lists(st.floats(), max_size=3), junk),
    "other": junk}, optional={"plateau": st.one_of(junk, st.fixed_dictionaries(
        {k: st.one_of(st.integers(0, 3), st.floats()) for k in sharded_state.PLATEAU_KEYS})),
        "epoch_sums": st.one_of(junk, st.lists(st.lists(st.floats(), min_size=4, max_size=4), max_size=3))}))


@SETTINGS
@given(states, st.integers(0, 3))
def test_state_json_loads_or_is_refused(tmp_path: Path, rss_bound, state, nesting: int) -> None:
    text = json.dumps(state)
    for _ in range(nesting):  # deeper than the bound, around a valid-looking state
        text = '{"other": ' + "[" * 5000 + "1" + "]" * 5000 + ", " + text[1:] if text.startswith("{") else text
    (tmp_path / sharded_state.STATE).write_text(text)
    try:
        saved = sharded_state.read(tmp_path)
    except UserError:
        return
    assert isinstance(saved["step"], int) and all(isinstance(lr, float) for lr in saved["lr"])
    try:
        sharded_state.restore({"w": {"step": 1}}, saved["other"], "state.json")
    except UserError:
        pass


boxes = st.integers(1, 3).flatmap(lambda ndim: st.dictionaries(
    st.tuples(*[st.integers(0, 4)] * ndim), st.tuples(*[st.integers(0, 3)] * ndim), min_size=1, max_size=6))


@SETTINGS
@given(chunks=boxes)
def test_chunks_are_accepted_exactly_when_they_tile_the_tensor(chunks: dict) -> None:
    """Any set of chunks: accepted only if every element of the tensor they span is in exactly one of them
    (counted element by element here); a tiling is refused only when its grid is over the cell bound."""
    ndim = len(next(iter(chunks)))
    saved = hf_dcp.SavedTensor("F32", ndim, dict(chunks))
    count = torch.zeros(saved.size, dtype=torch.int32)
    for offsets, shape in chunks.items():
        count[tuple(slice(o, o + s) for o, s in zip(offsets, shape))] += 1
    tiles = bool((count == 1).all())
    try:
        hf_dcp.check_cover("w", saved, Path("ckpt"), hf_dcp.DEFAULT_BOUNDS)
        accepted = True
    except UserError as e:
        accepted = False
        assert not tiles or "grid cells per shard" in str(e)
    assert accepted <= tiles

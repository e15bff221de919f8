"""Hostile input, fuzzed: the OIP request parser and the image decoder answer every byte string
with a result, a 4xx (HTTPError) or a BadImage - never another exception - and memory stays bounded.

Bounded in time: a fixed number of examples per property, no shrinking deadline.
"""

from __future__ import annotations

import io
import json
import resource

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from torchcls.data.images import BadImage, load_image
from torchcls.data.loaders import Preprocess
from torchcls.serve import oip
from torchcls.serve.http_errors import HTTPError

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Peak RSS may grow by at most this much over a whole fuzz run: one decoded 224 px image is
# ~150 KB; anything near this bound means a hostile header made the decoder allocate freely.
RSS_BOUND_MB = 300


def _info(max_batch: int = 8):
    from torchcls.artifacts import ArtifactInfo

    return ArtifactInfo("m", "eager", ["a", "b"], Preprocess(4, 1, (0.5,), (0.5,)), max_batch, "fp32")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=6), max_leaves=40)
infer_like = st.fixed_dictionaries({
    "inputs": st.lists(st.fixed_dictionaries({
        "name": st.sampled_from(["input", "x", ""]), "datatype": st.sampled_from(["FP32", "INT8", "BYTES"]),
        "shape": st.lists(st.integers(-3, 10), max_size=5), "data": json_values}), max_size=2),
    "outputs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["logits", "labels", "probabilities", "z"])}),
                        max_size=4)})


@FUZZ
@given(body=st.one_of(st.binary(max_size=512), infer_like.map(lambda d: json.dumps(d).encode()),
                      json_values.map(lambda d: json.dumps(d).encode())),
       header=st.one_of(st.none(), st.text(max_size=6), st.integers(-5, 600).map(str)))
def test_oip_parser_answers_4xx_or_a_tensor(body: bytes, header: str | None) -> None:
    info = _info()
    try:
        x, request = oip.parse_infer(body, header, info, max_batch=4)
        outputs = oip.requested_outputs(request)
    except HTTPError as e:
        assert 400 <= e.status < 500 and e.message
        return
    assert x.dtype.is_floating_point and tuple(x.shape[1:]) == (1, 4, 4) and 1 <= x.shape[0] <= 4
    assert len(set(outputs)) == len(outputs) and set(outputs) <= set(oip.OUTPUTS)


def _seed_images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8))
    seeds = {}
    for fmt, kwargs in {"PNG": {}, "JPEG": {"quality": 80}, "GIF": {}, "TIFF": {}, "WEBP": {"quality": 80}}.items():
        buf = io.BytesIO()
        im.save(buf, format=fmt, **kwargs)
        seeds[fmt] = buf.getvalue()
    return seeds


SEEDS = _seed_images()


@st.composite
def mutated_image(draw) -> bytes:
    data = bytearray(SEEDS[draw(st.sampled_from(sorted(SEEDS)))])
    for _ in range(draw(st.integers(1, 8))):  # flip bytes, anywhere; the header is where bombs hide
        pos = draw(st.integers(0, min(len(data) - 1, draw(st.sampled_from([64, len(data) - 1])))))
        data[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # truncate
    return bytes(data)


@pytest.fixture(scope="module")
def rss_before() -> float:
    return _peak_rss_mb()


@FUZZ
@given(data=mutated_image(), channels=st.sampled_from([1, 3]))
def test_decoder_answers_a_tensor_or_badimage(tmp_path, rss_before, data: bytes, channels: int) -> None:
    path = tmp_path / "fuzz.img"
    path.write_bytes(data)
    try:
        x = load_image(path, channels, min_side=32)
    except BadImage as e:
        assert str(e)
    else:
        assert x.dtype.is_floating_point is False and x.shape[0] == channels and x.ndim == 3
    assert _peak_rss_mb() - rss_before < RSS_BOUND_MB


def test_wide_strip_png_is_refused_before_any_resize(tmp_path) -> None:
    # 2,000,000 x 4 pixels in a few KB: Resize to 224 on the short side would allocate gigabytes.
    path = tmp_path / "strip.png"
    Image.new("L", (2_000_000, 4)).save(path, optimize=True)
    assert path.stat().st_size < 64_000
    before = _peak_rss_mb()
    with pytest.raises(BadImage, match="aspect ratio"):
        load_image(path, 3, min_side=224)
    assert _peak_rss_mb() - before < 200


def _infer_text(data: bytes, shape: str = "[1, 1, 4, 4]", extra: bytes = b"") -> bytes:
    return b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": ' + shape.encode() + b', "data": ' + data + \
        b"}]" + extra + b"}"


@pytest.mark.parametrize("where", ["data", "elsewhere"])
def test_31_mib_of_empty_lists_is_refused_before_any_list_is_built(where: str) -> None:
    """`[],[],...` as data (or beside it) cost the old parser 21 s of CPU and 1.9 GB: now a few counts."""
    import time
    import tracemalloc

    garbage = b"[" + b"[]," * (31 * 2**20 // 3) + b"[]]"
    body = _infer_text(garbage) if where == "data" else _infer_text(b"[0]", extra=b', "junk": ' + garbage)
    tracemalloc.start()
    cpu = time.process_time()
    try:
        with pytest.raises(HTTPError) as e:
            oip.parse_infer(body, None, _info(), max_batch=4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.status == 400
    assert ("values" if where == "data" else "outside input 'data'") in e.value.message
    assert peak < 2**20, peak  # not one nested list built (the old parser: ~10 M of them)
    assert time.process_time() - cpu < 2  # CPU seconds, not wall-clock: the old parser took ~10


def test_data_is_parsed_against_its_declared_shape() -> None:
    values = np.arange(16, dtype=np.float32)
    nested = json.dumps(values.reshape(1, 1, 4, 4).tolist()).encode()
    for data in (json.dumps(values.tolist()).encode(), nested, nested.replace(b",", b" ,\n  ")):
        x, _ = oip.parse_infer(_infer_text(data), None, _info(), max_batch=4)
        assert x.shape == (1, 1, 4, 4) and x.flatten().tolist() == values.tolist()
    for bad, why in ((b"[" + b"0," * 16 + b"0]", "17 values"), (b"[" * 9 + b"0" + b"]" * 8 + b"," + b"0," * 14 + b"0]", "nested"),
                     (b"[" + b"0" * 5000 + b"," + b"0," * 14 + b"0]", "bytes"), (b"[1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,{}]",
                                                                              "regular array")):
        with pytest.raises(HTTPError, match=why):
            oip.parse_infer(_infer_text(bad), None, _info(), max_batch=4)

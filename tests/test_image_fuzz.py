"""Property: for every allowed format Pillow can write, small random images saved in it, then their size
fields rewritten to random (often huge) values, bytes changed and the file cut short, decode to a uint8
CxHxW tensor within the pixel bound or to a BadImage - never another exception - in bounded time and
memory; and the start-up scan (read_header) refuses nothing the decoder would accept.
"""

from __future__ import annotations

import io
import struct
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from bounds_check import bounded, status_mb
from torchcls.data.images import ALLOWED_FORMATS, BadImage, decode_bytes, read_header

LIMIT = 1_000_000  # --max-pixels for these examples: an accepted image stays small, so RSS bounds stay tight
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# How each format is saved (several variants: multi-frame, progressive...) and how it writes a width and
# height, so that they can be found and rewritten: (struct format or a function of (w, h)) per occurrence.
SAVES = {
    "JPEG": [{}, {"progressive": True}, {"format": "MPO", "frames": 2}],
    "PNG": [{}, {"frames": 2}],
    "GIF": [{}, {"frames": 3}],
    "BMP": [{}],
    "TIFF": [{}, {"frames": 2}, {"compression": "tiff_deflate"}],
    "WEBP": [{"lossless": True}, {"quality": 50}, {"frames": 2, "lossless": True}],
    "PPM": [{}],
    "ICO": [{}],
}


def _size_fields(fmt: str, w: int, h: int) -> list:
    """Encodings of (w, h) as `fmt` stores them: each maps a (width, height) to bytes of the same layout."""
    tiff = [lambda a, b, t=t, f=f: struct.pack(f"<HHI{f}", 256, t, 1, a) for t, f in ((3, "H"), (4, "I"))]
    tiff += [lambda a, b, t=t, f=f: struct.pack(f"<HHI{f}", 257, t, 1, b) for t, f in ((3, "H"), (4, "I"))]
    return {
        "JPEG": [lambda a, b: struct.pack(">HH", b, a)],
        "PNG": [lambda a, b: struct.pack(">II", a, b)],
        "GIF": [lambda a, b: struct.pack("<HH", a, b)],
        "BMP": [lambda a, b: struct.pack("<II", a, b)],
        "TIFF": tiff,
        "WEBP": [lambda a, b: ((a - 1) % 2**24).to_bytes(3, "little") + ((b - 1) % 2**24).to_bytes(3, "little"),
                 lambda a, b: struct.pack("<I", ((a - 1) & 0x3FFF) | ((b - 1) & 0x3FFF) << 14)[:4]],
        "PPM": [lambda a, b: f"{a} {b}".encode()],
        "ICO": [lambda a, b: bytes([a & 255, b & 255]), lambda a, b: struct.pack(">II", a, b)],
    }[fmt]


HUGE = [0, 1, 255, 256, 4097, 16383, 65535, 2**24 - 1, 2**31 - 1, 2**32 - 1]


def _fit(layout, a: int, b: int) -> bytes:
    """`layout` of (a, b), each value cut to what the field holds (a struct.error means it does not fit)."""
    for mask in (2**32 - 1, 2**16 - 1, 2**8 - 1):
        try:
            return layout(a & mask, b & mask)
        except struct.error:
            continue
    return layout(1, 1)


@st.composite
def hostile_image(draw) -> tuple[str, bytes]:
    fmt = draw(st.sampled_from(sorted(SAVES)))
    kw = dict(draw(st.sampled_from(SAVES[fmt])))
    frames, save_as = kw.pop("frames", 1), kw.pop("format", fmt)
    w, h = draw(st.integers(17, 40)), draw(st.integers(17, 40))  # above 16: not confused with small fields
    mode = draw(st.sampled_from(["RGB", "L", "RGBA", "P"] if fmt not in ("JPEG", "PPM") else ["RGB", "L"]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)  # deterministic bytes: hypothesis replays an example exactly
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode) for _ in range(frames)]
    if fmt == "ICO":
        kw["sizes"] = [(w, h)]
    buf = io.BytesIO()
    ims[0].save(buf, format=save_as, save_all=frames > 1, append_images=ims[1:], **kw)
    data = bytearray(buf.getvalue())
    for layout in _size_fields(fmt, w, h):  # rewrite the declared size wherever it is written
        if draw(st.booleans()):
            old, new = layout(w, h), _fit(layout, draw(st.sampled_from(HUGE)), draw(st.sampled_from(HUGE)))
            data = bytearray(bytes(data).replace(old, new, draw(st.integers(1, 3))))
    for _ in range(draw(st.integers(0, 6))):
        pos = draw(st.integers(0, len(data) - 1))
        data[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return fmt, bytes(data)


def test_every_allowed_format_pillow_can_write_is_fuzzed():
    writable = {f for f in ALLOWED_FORMATS if f in Image.SAVE}
    assert writable == set(SAVES), "an allowed format without fuzz seeds (or seeds for one not allowed)"


@pytest.fixture(scope="module")
def rss_at_start() -> float:
    return status_mb("VmRSS")


@FUZZ
@given(case=hostile_image(), channels=st.sampled_from([1, 3]), min_side=st.sampled_from([None, 32]))
def test_decoder_answers_a_bounded_tensor_or_badimage(tmp_path, rss_at_start, case, channels, min_side):
    fmt, data = case
    path = tmp_path / "fuzz.img"
    path.write_bytes(data)
    start = time.perf_counter()
    with bounded(seconds=10.0, rss_mb=150):  # generous: shared CPUs; an accepted image is at most 1 MP here
        try:
            header = read_header(path)
        except BadImage as e:
            header = str(e)
        try:
            x = decode_bytes(data, channels, min_side, max_pixels=LIMIT)
        except BadImage as e:
            assert str(e)
        else:
            assert x.dtype == torch.uint8 and x.ndim == 3 and x.shape[0] == channels
            assert x.shape[1] * x.shape[2] <= LIMIT
            assert not isinstance(header, str), f"the scan refused what the decoder accepts: {header}"
    assert time.perf_counter() - start < 10.0
    assert status_mb("VmRSS") - rss_at_start < 200  # nothing piles up across examples either

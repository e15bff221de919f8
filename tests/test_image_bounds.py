"""Bounded before built: every size an image file declares (each frame, each embedded image) is read and
checked before Pillow decodes a pixel, the format comes from the bytes, and Pillow's own bomb check is on.

Issue 30, finding 2: a 3.5 MB .ico whose directory says 16x16 embeds a 30000x30000 RGBA PNG, which
Pillow decoded inside Image.open (1.8 GB and 58 s in decode_bytes on 0bcf6c5; two uploads took a
server from 757 MiB to 4.25 GB and answered 500).
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from bounds_check import bounded
from torchcls.data.image_formats import BOUNDS
from torchcls.data.images import ALLOWED_FORMATS, MAX_PIXELS, BadImage, decode_bytes, load_image, read_header


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def zero_png(width: int, height: int, zeros_mb: int, colour_type: int = 6) -> bytes:
    """A PNG of `width`x`height` whose IDAT inflates to `zeros_mb` MiB of zeros (all of it when that covers
    every row: a transparent black image). Built in milliseconds: each MiB of zeros after a full flush
    compresses to the same ~1 KB, so one block is repeated instead of compressing gigabytes."""
    c = zlib.compressobj(9)
    first = c.compress(bytes(2**20)) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(bytes(2**20)) + c.flush(zlib.Z_FULL_FLUSH)
    idat = first + again * (zeros_mb - 1)  # the stream ends without its checksum: the decoder stops there
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def hostile_ico(zeros_mb: int = 3433, side: int = 16, embedded: bytes | None = None) -> bytes:
    """Finding 2's file: one directory entry saying `side`x`side`, holding a 30000x30000 RGBA PNG (3433 MiB of
    zeros is every row of it: the 3.5 MB file of the report)."""
    body = embedded if embedded is not None else zero_png(30000, 30000, zeros_mb)
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", side, side, 0, 0, 1, 32, len(body), 22) + body


def test_ico_embedding_a_30000px_png_is_refused_before_any_pixel(tmp_path):
    data = hostile_ico()
    assert 3_000_000 < len(data) < 4_000_000
    with bounded(seconds=1.0, rss_mb=100), pytest.raises(BadImage, match="entry 1 embeds a 30000x30000 PNG"):
        decode_bytes(data, 3, 224)
    path = tmp_path / "favicon.ico"
    path.write_bytes(data)
    with bounded(seconds=1.0, rss_mb=100):  # the start-up scan reads the same headers and refuses the same file
        with pytest.raises(BadImage, match="30000x30000"):
            read_header(path)
        with pytest.raises(BadImage, match="30000x30000"):
            load_image(path, 3)


def test_two_concurrent_hostile_icos_stay_bounded():
    data, errors = hostile_ico(), []

    def one() -> None:
        try:
            decode_bytes(data, 3, 224)
        except BadImage as e:
            errors.append(str(e))

    with bounded(seconds=2.0, rss_mb=100):
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(errors) == 2 and all("30000x30000" in e for e in errors)


def test_every_ico_entry_is_read_not_only_the_one_pillow_picks():
    good = io.BytesIO()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(good, format="PNG")
    bomb = zero_png(30000, 30000, 4)
    entries = [(16, good.getvalue()), (8, bomb)]  # the bomb is the smaller entry by its directory
    head = struct.pack("<HHH", 0, 1, len(entries))
    offset, table, body = 6 + 16 * len(entries), b"", b""
    for side, blob in entries:
        table += struct.pack("<BBBBHHII", side, side, 0, 0, 1, 32, len(blob), offset + len(body))
        body += blob
    with bounded(), pytest.raises(BadImage, match="entry 2 embeds a 30000x30000 PNG"):
        decode_bytes(head + table + body, 3)
    dib = struct.pack("<IiiHHIIiiII", 40, 30000, 60000, 1, 32, 0, 0, 0, 0, 0, 0)  # a BMP entry: mask doubles h
    with bounded(), pytest.raises(BadImage, match="embeds a 30000x30000 BMP"):
        decode_bytes(hostile_ico(embedded=dib), 3)


def _saved(fmt: str, frames: int = 1, size=(8, 6), **kw) -> bytes:
    ims = [Image.new("RGB", size, (40 * i, 200, 30)) for i in range(frames)]
    kw = {"sizes": [size], **kw} if fmt == "ICO" else kw
    buf = io.BytesIO()
    ims[0].save(buf, format=fmt, save_all=frames > 1, append_images=ims[1:], **kw)
    return buf.getvalue()


def _tiff_page_size(data: bytes, page: int, width: int, height: int) -> bytes:
    """`data` (a little-endian TIFF) with page `page`'s width and length tags rewritten as LONGs (and its rows per
    strip to the new length, so that its one strip still covers the image as the layout check requires)."""
    out, ifd = bytearray(data), struct.unpack_from("<I", data, 4)[0]
    for _ in range(page):
        ifd = struct.unpack_from("<I", data, ifd + 2 + 12 * struct.unpack_from("<H", data, ifd)[0])[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        at = ifd + 2 + 12 * i
        tag = struct.unpack_from("<H", data, at)[0]
        if tag in (256, 257, 278):
            struct.pack_into("<HHII", out, at, tag, 4, 1, width if tag == 256 else height)
    return bytes(out)


def test_multi_page_and_multi_frame_files_decode_frame_0_only():
    """A huge later page or frame is never decoded (nor counted): frame 0 comes back, quickly."""
    tiff = _tiff_page_size(_saved("TIFF", 2), 1, 30000, 30000)
    gif = _saved("GIF", 2)
    frames = [i for i in range(len(gif)) if gif[i:i + 9] == b"," + struct.pack("<4H", 0, 0, 8, 6)]
    assert len(frames) == 2
    gif = gif[:frames[1] + 5] + struct.pack("<HH", 65535, 65535) + gif[frames[1] + 9:]
    apng = bytearray(_saved("PNG", 2))
    fctl = [i - 4 for i in range(len(apng)) if apng[i:i + 4] == b"fcTL"][1]
    struct.pack_into(">II", apng, fctl + 12, 30000, 30000)
    apng[fctl + 34:fctl + 38] = struct.pack(">I", zlib.crc32(apng[fctl + 4:fctl + 34]))
    for name, data in {"TIFF page 2": tiff, "GIF frame 2": gif, "APNG frame 2": bytes(apng)}.items():
        with bounded():
            assert tuple(decode_bytes(data, 3).shape) == (3, 6, 8), name
    with bounded(), pytest.raises(BadImage, match="above the --max-pixels limit"):
        decode_bytes(_tiff_page_size(_saved("TIFF", 2), 0, 30000, 30000), 3)


def test_huge_screens_canvases_and_frames_are_refused_from_their_headers():
    gif = _saved("GIF")
    screen = gif[:6] + struct.pack("<HH", 65535, 65535) + gif[10:]
    first = gif.index(b"," + struct.pack("<4H", 0, 0, 8, 6))
    extent = gif[:first + 1] + struct.pack("<4H", 60000, 60000, 8, 6) + gif[first + 9:]  # frame 0 off the screen
    webp = bytearray(_saved("WEBP", 2, lossless=True))
    canvas = bytearray(webp)
    canvas[24:30] = (16383).to_bytes(3, "little") * 2  # VP8X canvas 16384x16384
    anmf = [i for i in range(len(webp)) if webp[i:i + 4] == b"ANMF"][1]
    webp[anmf + 14:anmf + 20] = (2**24 - 1).to_bytes(3, "little") * 2  # frame 2 larger than the canvas
    cases = {"GIF screen": (screen, "above the --max-pixels"), "GIF frame 0 extent": (extent, "above the --max-pixels"),
             "WEBP canvas": (bytes(canvas), "above the --max-pixels"), "WEBP frame": (bytes(webp), "outside its"),
             "PNG": (zero_png(100_000, 100_000, 1, colour_type=2), "above the --max-pixels")}
    for name, (data, reason) in cases.items():
        with bounded(), pytest.raises(BadImage, match=reason):
            decode_bytes(data, 3, 224)


def test_format_comes_from_the_bytes_not_the_name(tmp_path):
    (tmp_path / "photo.jpg").write_bytes(_saved("PNG"))
    (tmp_path / "photo.png").write_bytes(_saved("GIF"))
    assert read_header(tmp_path / "photo.jpg") == ("PNG", 8, 6)
    assert read_header(tmp_path / "photo.png") == ("GIF", 8, 6)
    assert load_image(tmp_path / "photo.jpg", 3).shape == (3, 6, 8)


OUTSIDE = {  # formats Pillow opens that the allow-list leaves out (image_formats.py says why for each)
    "EPS": _saved("EPS"), "PCX": _saved("PCX"), "TGA": _saved("TGA"), "QOI": b"qoif" + struct.pack(">IIBB", 8, 6, 3, 0) + b"\xfe\x0a\xc8\x1e" + bytes(7) + b"\x01", "DIB": _saved("DIB"),
    "PSD": b"8BPS\x00\x01" + bytes(20) + b"\x00\x03" + bytes(40), "PFM": b"Pf\n2 2\n-1.0\n" + bytes(16),
    "text": b"GIF88a is no GIF version\n", "RIFF WAVE": b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(28),
}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_formats_outside_the_allow_list_never_reach_pillow(name, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError(f"Pillow opened {name} bytes")

    monkeypatch.setattr(Image, "open", must_not_run)
    with pytest.raises(BadImage, match="not an image"):
        decode_bytes(OUTSIDE[name], 3)


def test_pillow_opens_only_the_format_the_bytes_name(monkeypatch):
    seen, real_open = [], Image.open

    def spy(fp, mode="r", formats=None):
        seen.append(formats)
        return real_open(fp, mode, formats)

    monkeypatch.setattr(Image, "open", spy)
    for fmt in ALLOWED_FORMATS:
        assert tuple(decode_bytes(_saved(fmt), 3).shape) == (3, 6, 8), fmt
    assert seen == [[fmt] for fmt in ALLOWED_FORMATS]


@pytest.mark.slow  # a fresh process, so that no earlier call has raised Pillow's limit
def test_pillow_bomb_check_is_on_and_each_call_keeps_its_own_limit():
    """In a fresh process: Pillow's limit starts at the project's bound, a call asking more raises it (never
    lowers it, so a concurrent call is never refused by another's lower limit), 0 turns it off; and a call's
    own --max-pixels still holds after another call has lifted Pillow's."""
    script = """
import io, sys
from PIL import Image
from torchcls.data.images import BadImage, decode_bytes
sys.path.insert(0, sys.argv[1])
from test_image_bounds import zero_png
big = zero_png(3000, 3000, 9, colour_type=0)
seen = [Image.MAX_IMAGE_PIXELS]
try:
    Image.open(io.BytesIO(zero_png(30000, 30000, 1)))  # Pillow alone, past our reader: its own check refuses
except Image.DecompressionBombError:
    seen.append("bomb")
for limit in (10**9, 10**6, 0):
    try:
        seen.append((limit, tuple(decode_bytes(big, 1, max_pixels=limit).shape), Image.MAX_IMAGE_PIXELS))
    except BadImage as e:
        seen.append((limit, "refused", Image.MAX_IMAGE_PIXELS))
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == str([4 * MAX_PIXELS, "bomb", (10**9, (1, 3000, 3000), 4 * 10**9),
                               (10**6, "refused", 4 * 10**9), (0, (1, 3000, 3000), None)])


def test_metadata_and_structure_bounds():
    exif = bytearray(_saved("PNG"))
    at = exif.index(b"IDAT") - 4
    exif[at:at] = png_chunk(b"eXIf", b"MM\x00*" + bytes(70_000))
    junk = _saved("PNG")[:33] + png_chunk(b"tEXt", b"") * 100_001 + _saved("PNG")[33:]
    tiff = bytearray(_saved("TIFF"))
    struct.pack_into("<H", tiff, struct.unpack_from("<I", tiff, 4)[0], 5000)
    ppm = b"P6\n#" + b"x" * 10_000 + b"\n8 6\n255\n" + bytes(144)
    scans = _saved("JPEG", progressive=True)
    scans = scans[:-2] + (b"\xff\xda\x00\x08\x01\x01\x00\x00\x00\x00") * 300 + b"\xff\xd9"
    tiles = b"".join(struct.pack("<HHII", t, 4, 1, v) for t, v in ((256, 8), (257, 6), (322, 2**16), (323, 2**16)))
    tiled = b"II*\x00" + struct.pack("<IH", 8, 4) + tiles + bytes(4)
    app = _saved("JPEG")
    app = app[:2] + (b"\xff\xef\xff\xff" + bytes(65533)) * 300 + app[2:]  # 300 APP15 segments of 64 KB
    cases = {"an Exif block of 70,004 bytes": bytes(exif), "more than 100,000 chunks": junk,
             "more than 1,024 tags": bytes(tiff), "no width and height in its first 4,096 bytes": ppm,
             "more than 256 scans": scans, "a 65536x65536 tile for a 8x6 image": tiled,
             "more than 16,777,216 bytes of metadata": app}
    for reason, data in cases.items():
        with bounded(), pytest.raises(BadImage, match=reason):
            decode_bytes(data, 3)


# --- TIFF strips and tiles (issue 30 review: a 1x2 TIFF listing a million strip offsets, 1.9 MB, took 7.8 s and
# +250 MiB in decode_bytes on 0bcf6c5: Pillow builds one Python tile per offset whatever the image's size) ---

def tiff_bytes(width: int, height: int, *, spp: int = 1, planar: int = 1, rows: int | None = None,
               tile: tuple[int, int] | None = None, offsets: int | None = None, counts: int | None = None,
               extra: tuple = ()) -> bytes:
    """A little-endian, uncompressed 8-bit TIFF in strips of `rows` rows or in `tile` (w, h) tiles, each block
    holding pixels of value 7. `offsets` / `counts`: list that many offsets / byte counts instead of the right
    number (None: the right number; 0: leave the tag out). `extra`: more (tag, type, values) entries."""
    planes = spp if planar == 2 else 1
    if tile:
        blocks = -(-width // tile[0]) * -(-height // tile[1]) * planes
        block_bytes, tags = tile[0] * tile[1] * (spp // planes), [(322, 3, [tile[0]]), (323, 3, [tile[1]])]
        off_tag, cnt_tag = 324, 325
    else:
        rows = rows or height
        blocks, block_bytes = -(-height // rows) * planes, rows * width * (spp // planes)
        tags, off_tag, cnt_tag = [(278, 4, [rows])], 273, 279
    pixels, n_off = b"\x07" * block_bytes, blocks if offsets is None else offsets
    tags += [(256, 4, [width]), (257, 4, [height]), (258, 3, [8] * spp), (259, 3, [1]), (262, 3, [1 if spp == 1 else 2]),
             (277, 3, [spp]), (284, 3, [planar]), *extra]
    if n_off:
        tags.append((off_tag, 4, ["pixels"] * n_off))
    if counts != 0:
        tags.append((cnt_tag, 4, [block_bytes] * (blocks if counts is None else counts)))
    tags.sort(key=lambda t: t[0])
    sizes = {3: ("H", 2), 4: ("I", 4)}
    ifd_end = 8 + 2 + 12 * len(tags) + 4
    values_at, area = ifd_end, b""
    pix_at = ifd_end + sum(len(v) * sizes[t][1] for _, t, v in tags if len(v) * sizes[t][1] > 4)
    entries = b""
    for tag, typ, vals in tags:
        fmt, size = sizes[typ]
        packed = struct.pack(f"<{len(vals)}{fmt}", *[pix_at if v == "pixels" else v for v in vals])
        if len(packed) <= 4:
            entries += struct.pack("<HHI", tag, typ, len(vals)) + packed.ljust(4, b"\0")
        else:
            entries += struct.pack("<HHII", tag, typ, len(vals), values_at + len(area))
            area += packed
    return b"II*\0" + struct.pack("<IH", 8, len(tags)) + entries + bytes(4) + area + pixels * max(blocks, 1)


def test_tiff_strips_and_tiles_as_the_specification_lays_them_out_decode():
    for name, data, shape in [("strips of 1 row", tiff_bytes(8, 5, rows=1), (1, 5, 8)),
                              ("one strip", tiff_bytes(8, 5), (1, 5, 8)),
                              ("6 tiles of 16x16", tiff_bytes(40, 20, tile=(16, 16)), (1, 20, 40)),
                              ("3 planes of 2 strips", tiff_bytes(8, 4, spp=3, planar=2, rows=2), (3, 4, 8)),
                              ("no byte counts", tiff_bytes(8, 5, rows=2, counts=0), (1, 5, 8))]:
        x = decode_bytes(data, shape[0])
        assert tuple(x.shape) == shape and int(x.min()) == int(x.max()) == 7, name
        assert read_header_of(data) == ("TIFF", shape[2], shape[1]), name


def read_header_of(data: bytes) -> tuple[str, int, int]:
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".tif") as f:
        f.write(data)
        f.flush()
        return read_header(Path(f.name))


def test_tiff_offsets_and_byte_counts_must_match_the_layout():
    million = tiff_bytes(1, 2, rows=1, offsets=1_000_000, counts=0)  # the review's file: 4 MB, a 1x2 image
    with bounded(seconds=1.0, rss_mb=60), pytest.raises(BadImage, match="1,000,000 offsets for a 1x2 image in "
                                                                        "strips of 1 rows, which has 2"):
        decode_bytes(million, 1)
    cases = {"4 byte counts for a 8x5 image in strips of 2 rows, which has 3": tiff_bytes(8, 5, rows=2, counts=4),
             "7 offsets for a 40x20 image in 16x16 tiles, which has 6": tiff_bytes(40, 20, tile=(16, 16), offsets=7),
             "2 offsets for a 8x4 image in strips of 2 rows over 3 planes, which has 6":
                 tiff_bytes(8, 4, spp=3, planar=2, rows=2, offsets=2),
             "no strip or tile offsets": tiff_bytes(8, 5, offsets=0),
             "both strip offsets and tiles": tiff_bytes(8, 5, extra=((324, 4, [8]),)),
             "0 rows per strip": tiff_bytes(8, 5).replace(struct.pack("<HHII", 278, 4, 1, 5),
                                                          struct.pack("<HHII", 278, 4, 1, 0))}
    for reason, data in cases.items():
        with bounded(), pytest.raises(BadImage, match=reason):
            decode_bytes(data, 1)
        with pytest.raises(BadImage, match=reason):  # the start-up scan refuses what the decoder would
            read_header_of(data)


def test_tiff_block_and_tag_value_counts_are_bounded():
    tall = tiff_bytes(1, 65_537, rows=1)  # laid out right, but 65,537 Python tiles
    with bounded(), pytest.raises(BadImage, match="stored as 65,537 strips of 1 rows \\(limit 65,536\\)"):
        decode_bytes(tall, 1)
    assert tuple(decode_bytes(tiff_bytes(1, 65_536, rows=1), 1).shape) == (1, 65_536, 1)  # the bound itself
    many = tiff_bytes(8, 5, extra=((65000, 3, [513] * 2_000_000),))  # 4 MB of numbers: a tuple of 2M ints
    bps = tiff_bytes(8, 5)
    bps = bps.replace(struct.pack("<HHI", 258, 3, 1), struct.pack("<HHI", 258, 3, 8_000_000)) + bytes(16_000_000)
    for data, reason in ((many, "tag 65000 holds 2,000,000 numbers"), (bps, "tag 258 holds 8,000,000 numbers")):
        with bounded(seconds=1.0, rss_mb=60), pytest.raises(BadImage, match=reason + " \\(limit 196,608\\)"):
            decode_bytes(data, 1)


# --- Work Pillow does in Python out of proportion to the file (security review, size findings): plain PNM, RLE BMP,
# PNG iCCP/zTXt/iTXt inflation, and an ICO's walks of its embedded PNGs. Each is refused by `probe`, before Pillow
# opens the bytes (Image.open must not run), on both paths: decode_bytes and the start-up scan's read_header. ---

def _refused_before_pillow(data: bytes, reason: str, monkeypatch, tmp_path, scan: bool = True) -> None:
    """`data` is refused with `reason` by decode_bytes and (`scan`) read_header, and Pillow never sees it; the
    callers name the file (a BadImage is the reason: loaders, predict and the scan pair it with the path)."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("Pillow opened a file probe should have refused")

    monkeypatch.setattr(Image, "open", must_not_run)
    with pytest.raises(BadImage, match=reason):
        decode_bytes(data, 3)
    if scan:
        path = tmp_path / "hostile.img"
        path.write_bytes(data)
        with pytest.raises(BadImage, match=reason):
            read_header(path)
    monkeypatch.undo()


def _pnm(magic: bytes, header: bytes, raster: bytes) -> bytes:
    return magic + b"\n" + header + raster


@pytest.mark.parametrize("magic", [b"P1", b"P2", b"P3"])
def test_plain_pnm_is_refused_with_the_conversion_to_make(magic, monkeypatch, tmp_path):
    """Pillow's PpmPlainDecoder strips each comment by rebuilding its 1 MiB block: 1 MiB of '#\\n' took 12 s."""
    data = _pnm(magic, b"1 1\n" + (b"" if magic == b"P1" else b"255\n"), b"#\n" * 2048 + b"1\n")
    _refused_before_pillow(data, rf"PPM: a plain \(ASCII\) {magic.decode()} file.*convert it to binary PNM "
                           r"\(P4-P6\) or PNG", monkeypatch, tmp_path)


def test_binary_pnm_header_is_bounded_to_its_maxval(monkeypatch, tmp_path):
    """Pillow reads a comment before the maxval a byte at a time too (20 MiB took 5.6 s): the maxval must lie
    in the bounded header; a maxval Pillow converts in Python is bounded by its samples."""
    late = _pnm(b"P6", b"1 1\n#" + b"x" * 5000 + b"\n255\n", bytes(3))
    _refused_before_pillow(late, "no maxval in its first 4,096 bytes", monkeypatch, tmp_path)
    bad = _pnm(b"P5", b"1 1\n70000\n", bytes(2))
    _refused_before_pillow(bad, "maxval 70000", monkeypatch, tmp_path)
    slow = _pnm(b"P6", b"1024 1024\n65535\n", b"")  # 3 Mi samples for PpmDecoder, one Python step each
    _refused_before_pillow(slow, r"1024x1024 P6 with maxval 65535: .*3,145,728 samples in Python.*convert it to PNG",
                           monkeypatch, tmp_path)


def _bmp_bytes(width: int, height: int, compression: int = 0, bpp: int = 8, rows: bytes | None = None) -> bytes:
    """A palette BMP; RLE8/RLE4 `rows` are "one pixel, then end of line" (4 bytes a row, any width)."""
    colours = 16 if bpp == 4 else 256
    palette = b"".join(bytes((i, i, i, 0)) for i in range(colours))
    if rows is None:
        rows = (b"\x01\x05\x00\x00" * height + b"\x00\x01" if compression else
                bytes(((width * bpp + 31) // 32 * 4) * height))
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bpp, compression, len(rows), 2835, 2835, colours, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(rows), 0, 0, offset) + info + palette + rows


@pytest.mark.parametrize(("compression", "bpp", "name"), [(1, 8, "RLE8"), (2, 4, "RLE4")])
def test_rle_bmp_is_refused_in_a_file_and_in_an_icon(compression, bpp, name, monkeypatch, tmp_path):
    """Pillow's BmpRleDecoder runs in Python a byte per step and pads each row: 17 KB stating 16 MP took 2.2 s."""
    data = _bmp_bytes(4000, 4000, compression, bpp)
    assert len(data) < 20_000
    _refused_before_pillow(data, f"BMP: its pixels are {name}-compressed.*re-save it uncompressed or as PNG",
                           monkeypatch, tmp_path)
    dib = _bmp_bytes(16, 32, compression, bpp)[14:]  # an icon's BMP: no file header, the mask doubles the height
    _refused_before_pillow(hostile_ico(embedded=dib), f"ICO: an embedded BMP's pixels are {name}-compressed",
                           monkeypatch, tmp_path)


def _png_with(before: list[bytes], after: list[bytes] = ()) -> bytes:
    """A 16x16 greyscale PNG with chunks `before` its IDAT and `after` it."""
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 16, 16, 8, 0, 0, 0, 0))
    idat = png_chunk(b"IDAT", zlib.compress(b"\0" * 17 * 16))
    return b"\x89PNG\r\n\x1a\n" + ihdr + b"".join(before) + idat + b"".join(after) + png_chunk(b"IEND", b"")


ICC_BOMB = png_chunk(b"iCCP", b"p\0\0" + zlib.compress(bytes(2**20 - 16), 9))  # ~1 KB inflating to ~1 MB


def test_png_has_one_icc_profile_and_a_budget_of_compressed_metadata(monkeypatch, tmp_path):
    _refused_before_pillow(_png_with([ICC_BOMB] * 3), "PNG: a second ICC profile", monkeypatch, tmp_path)
    # after IDAT, Pillow's load() inflates it all the same: decode_bytes refuses it (the scan reads up to IDAT,
    # as Image.open does, and decoding refuses the file)
    _refused_before_pillow(_png_with([ICC_BOMB], [ICC_BOMB]), "a second ICC profile", monkeypatch, tmp_path,
                           scan=False)
    # zTXt and iTXt share the budget with iCCP, before or after IDAT: 40 chunks of 30 KB (the bytes, not the
    # count, over it; the contents do not matter, Pillow never sees them)
    ztxt = png_chunk(b"zTXt", b"k\0\0" + bytes(30_000))
    itxt = png_chunk(b"iTXt", b"k\0\1\0\0\0" + bytes(30_000))
    _refused_before_pillow(_png_with([ztxt] * 20, [itxt] * 20), r"more than 1,048,576 bytes of compressed "
                           r"metadata \(iCCP, zTXt, iTXt", monkeypatch, tmp_path, scan=False)
    one = png_chunk(b"iCCP", b"p\0\0" + bytes(BOUNDS.max_png_packed_metadata))  # one profile over the budget
    _refused_before_pillow(_png_with([one]), "more than 1,048,576 bytes of compressed", monkeypatch, tmp_path)
    # and their number: 65 chunks of ~1 KB each inflate 65 MB, though their bytes are well under the budget (an
    # iTXt whose text is not UTF-8 escapes Pillow's own 64 MB text budget, after being inflated)
    small = png_chunk(b"iTXt", b"k\0\1\0\0\0" + zlib.compress(b"\xff" * (2**20 - 100), 9))  # not UTF-8
    _refused_before_pillow(_png_with([], [small] * 65), "more than 64 compressed metadata chunks", monkeypatch,
                           tmp_path, scan=False)
    assert len(_png_with([], [small] * 65)) < BOUNDS.max_png_packed_metadata // 10


def _ico_of(images: list[bytes], offsets: list[int] | None = None) -> bytes:
    head = struct.pack("<HHH", 0, 1, len(images))
    at, table, body = 6 + 16 * len(images), b"", b""
    for k, blob in enumerate(images):
        offset = offsets[k] if offsets is not None else at + len(body)
        table += struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(blob), offset)
        body += blob if offsets is None or k == 0 else b""
    return head + table + body


def test_ico_walks_share_one_block_budget_and_entries_never_share_bytes(monkeypatch, tmp_path):
    """256 entries all pointing at one PNG of 100k chunks took 9.5 s: each walk had its own 100,000-block budget."""
    chunky = _png_with([png_chunk(b"tEXt", b"")] * 40_000)
    at = 6 + 16 * 3
    _refused_before_pillow(_ico_of([chunky] * 3, [at] * 3), r"ICO: entries 1 and 2 share image bytes",
                           monkeypatch, tmp_path)
    _refused_before_pillow(_ico_of([chunky, chunky[:100]], [at, at + 50]), "entries 1 and 2 share image bytes",
                           monkeypatch, tmp_path)
    # three distinct PNGs of 40,000 chunks each: 120,000 chunks in one file, over the one budget
    _refused_before_pillow(_ico_of([chunky] * 3), "ICO: more than 100,000 chunks", monkeypatch, tmp_path)
    assert read_header_of(_ico_of([chunky] * 2)) == ("ICO", 16, 16)  # 80,000: under it


def test_normal_files_of_each_touched_format_still_decode(tmp_path):
    p6 = _pnm(b"P6", b"# a comment\n8 6\n# another\n255\n", bytes(range(144)))
    p5_16 = _pnm(b"P5", b"8 6\n1023\n", bytes(96))  # PpmDecoder, well under its sample bound
    bmp = _bmp_bytes(8, 6)
    icc = Image.new("RGB", (8, 6), (10, 20, 30))
    profile = b"\0" * 3000  # Pillow stores any bytes as the profile (an ICC profile is a few KB)
    text = PngInfo()
    text.add_text("Comment", "a note " * 100, zip=True)
    text.add_itxt("XML:com.adobe.xmp", "<x:xmpmeta/>" * 100, zip=True)
    buf = io.BytesIO()
    icc.save(buf, format="PNG", icc_profile=profile, pnginfo=text)
    png = buf.getvalue()
    assert (png.count(b"iCCP"), png.count(b"zTXt"), png.count(b"iTXt")) == (1, 1, 1)
    ico = _saved("ICO", size=(16, 16))
    dib_ico = _saved("ICO", size=(16, 16), bitmap_format="bmp")  # an uncompressed BMP entry
    for name, data, shape in (("P6", p6, (3, 6, 8)), ("P5 maxval 1023", p5_16, (3, 6, 8)), ("BMP", bmp, (3, 6, 8)),
                              ("PNG with iCCP", png, (3, 6, 8)), ("ICO", ico, (3, 16, 16)),
                              ("ICO with a BMP", dib_ico, (3, 16, 16))):
        assert tuple(decode_bytes(data, 3).shape) == shape, name
        path = tmp_path / "ok"
        path.write_bytes(data)
        assert read_header(path)[0] == {"P6": "PPM", "P5 maxval 1023": "PPM", "PNG with iCCP": "PNG",
                                        "ICO with a BMP": "ICO"}.get(name, name), name
    with Image.open(io.BytesIO(png)) as im:
        assert im.info["icc_profile"] == profile

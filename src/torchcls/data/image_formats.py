"""Name an image's format from its first bytes and read every size it declares, before Pillow sees it.

Pillow is handed only the format named here (`Image.open(fp, formats=[fmt])`): no other plugin ever
parses the bytes, and a file whose extension lies is read as what its bytes are. Each reader walks
its format's structure with bounded counts and reports the largest image Pillow may allocate for
frame 0, the only frame ever decoded (nothing here or in images.py seeks to a later frame or reads
`n_frames`). For a container, every embedded image's size is read: an ICO entry's PNG or BMP is
decoded by Pillow inside `Image.open`, so it must be bounded before Pillow is called at all.

Formats left out, and why: DIB (no signature: any file starting with a header length "is" one), TGA
(no signature: any 18 bytes with two plausible flags parse as a header), QOI (Pillow decodes it in
Python, one pixel at a time: a 1 MB file of 64 MP costs a minute of CPU), PFM and the Pillow-only
PPM variants, and every other plugin (EPS/PS start Ghostscript; the rest see little hostile input).
Refused inside accepted formats for the same reason (Pillow decodes them in Python, at a cost out of proportion
to the file): plain (ASCII) P1-P3 PNM, RLE8/RLE4 BMP (a file's or an ICO entry's), and P5/P6 above
`max_ppm_python_samples` whose maxval Pillow converts in Python.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO


@dataclass(frozen=True)
class Bounds:
    """Every bound the image reader and decoder apply, in one place (docs/security.md lists them)."""
    max_pixels: int = 64_000_000      # default --max-pixels: pixels decoded (after any JPEG reduction)
    resize_limit: int = 16_000_000    # pixels of the copy resized to the model's input
    reduced_jpeg_factor: int = 4      # a one-scan JPEG decoded reduced may store 4x --max-pixels
    max_blocks: int = 100_000         # PNG/WebP chunks, JPEG segments, GIF blocks walked in one file (one budget per
                                      # probe: an ICO's walks of its embedded PNGs share it)
    max_scans: int = 256              # scans of a progressive JPEG: each is a pass over every coefficient
    max_jpeg_segments: int = 16 * 2**20  # bytes of JPEG segments before the image data (Pillow keeps them all)
    max_components: int = 4           # JPEG colour components (Pillow decodes 1, 3 or 4)
    max_exif_bytes: int = 65_535      # an Exif block (JPEG's own APP1 limit, kept for PNG eXIf / WebP EXIF)
    # Compressed bytes of a file's PNG iCCP + zTXt + iTXt chunks together. Pillow inflates each (up to 1 MB apiece)
    # inside Image.open or load, with no total for iCCP nor for an iTXt it then drops: ~2 s per MiB of such chunks.
    # A camera or editor ICC profile compresses to 1-60 KB and text to a few KB, so a real photo never gets near.
    max_png_packed_metadata: int = 2**20
    # ...and their number: ~1 KB of zlib inflates to Pillow's 1 MB cap, so the bytes alone let 1,000 chunks cost 2 s.
    # A real file has one profile and a few text chunks (XMP, Exif or IPTC as "Raw profile" zTXt).
    max_png_packed_chunks: int = 64
    max_icon_side: int = 256          # the largest side an ICO directory can state (a 0 byte means 256)
    max_icon_entries: int = 256
    max_tiff_tags: int = 1_024        # entries in IFD 0
    max_tiff_values: int = 16 * 2**20  # bytes of tag values IFD 0 points to
    max_tiff_tile: int = 2**20        # pixels of a TIFF tile larger than the image (padding)
    max_tiff_blocks: int = 65_536     # strips or tiles (x planes) of TIFF IFD 0: Pillow builds one tile object each
    max_tiff_numbers: int = 3 * 2**16  # numbers in one other TIFF tag (a 16-bit ColorMap): each a Python object
    max_ppm_header: int = 4_096       # bytes of a PBM/PGM/PPM header (magic, size, maxval), comments included
    # Samples of a P5/P6 whose maxval is neither 255 nor (P5) 65535: Pillow's PpmDecoder converts each in Python
    # (~0.7 us a sample here, a minute for a 64 MP greyscale file). 2**20: under a second; larger ones go to PNG.
    max_ppm_python_samples: int = 2**20
    max_file_bytes: int = 256 * 2**20  # an encoded image, read whole: a file, a shard member, a table cell


BOUNDS = Bounds()
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class BadImage(Exception):
    """An image file that cannot become a tensor; str() is the reason."""


@dataclass(frozen=True)
class Probe:
    format: str      # Pillow's name for it, what Image.open(formats=[...]) is given
    width: int       # the largest image Pillow may allocate for frame 0
    height: int
    reducible: bool = False  # a JPEG libjpeg decodes reduced in one streaming pass (one scan, all components)


class _Source:
    """Bounded random access to the bytes (an in-memory buffer or a file), every read checked against the end."""

    def __init__(self, fp: BinaryIO, size: int, fmt: str = ""):
        self.fp, self.size, self.fmt = fp, size, fmt
        self.blocks = 0  # chunks, markers, blocks walked: one budget for the whole file, however many walks
        self.packed = self.packed_chunks = 0  # PNG iCCP/zTXt/iTXt chunks and their bytes, all embedded PNGs together

    def at(self, offset: int, n: int) -> bytes:
        if offset < 0 or offset + n > self.size:
            raise self.corrupt(f"a field at byte {offset} lies past the end of the file ({self.size} bytes)")
        self.fp.seek(offset)
        return self.fp.read(n)

    def unpack(self, fmt: str, offset: int) -> tuple:
        return struct.unpack(fmt, self.at(offset, struct.calcsize(fmt)))

    def block(self, what: str) -> None:
        """One more chunk, marker or block walked, against `max_blocks` for the whole file (an ICO's entries
        share it: one budget per probe, not per walk)."""
        self.blocks += 1
        if self.blocks > BOUNDS.max_blocks:
            raise self.too_many(what, BOUNDS.max_blocks)

    def corrupt(self, why: str) -> BadImage:
        return BadImage(f"truncated or corrupted {self.fmt} header: {why}")

    def too_many(self, what: str, limit: int) -> BadImage:
        return BadImage(f"{self.fmt}: more than {limit:,} {what} (a bound on the work of reading its header)")


def probe(fp: BinaryIO, size: int, whole: bool = True) -> Probe:
    """The format of the bytes in `fp` (`size` long) and the largest image frame 0 needs, or BadImage.

    `whole`: the bytes will be decoded, so checks that read the whole file (a JPEG's scan count) run too;
    False for the start-up scan, which reads headers only."""
    src = _Source(fp, size)
    head = src.at(0, min(size, 16))
    for magic, fmt, reader in _FORMATS:
        if any(head.startswith(m) for m in magic):
            src.fmt = fmt
            return reader(src, whole)
    raise BadImage(f"not an image (unrecognised format; accepted: {', '.join(ALLOWED_FORMATS)})")


def _jpeg(src: _Source, whole: bool) -> Probe:
    pos, frame, kept = 2, None, 0
    while True:
        src.block("markers before the image data")
        ff, marker = src.at(pos, 2)
        if ff != 0xFF or marker in (0xFF, 0x00):  # junk, fill or a stuffed byte: Pillow and libjpeg skip them
            pos += 1 if ff != 0xFF or marker == 0xFF else 2
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no length
            pos += 2
            continue
        if marker in (0xD8, 0xD9):
            raise src.corrupt("no image data (start or end of image before the first scan)")
        (length,) = src.unpack(">H", pos + 2)
        if length < 2:
            raise src.corrupt(f"segment length {length} at byte {pos}")
        kept += length
        if kept > BOUNDS.max_jpeg_segments:
            raise BadImage(f"JPEG: more than {BOUNDS.max_jpeg_segments:,} bytes of metadata segments before its "
                           "image data (a bound on what reading its header keeps in memory)")
        if marker in _SOF:
            if frame is not None:
                raise src.corrupt("two frame headers (SOF)")
            _, height, width, comps = src.unpack(">BHHB", pos + 4)
            if not width or not height or not 1 <= comps <= BOUNDS.max_components:
                raise src.corrupt(f"frame of {width}x{height} with {comps} components")
            frame = (width, height, comps, marker in _PROGRESSIVE)
        elif marker == 0xDA:  # the first scan: what follows is entropy-coded data
            if frame is None:
                raise src.corrupt("image data before the frame header (SOF)")
            width, height, comps, progressive = frame
            multi_scan = progressive or src.at(pos + 4, 1)[0] < comps  # libjpeg then buffers every coefficient
            if multi_scan and whole:
                src.fp.seek(0)  # 0xFF 0xDA cannot occur in entropy-coded data (0xFF is stuffed there)
                if src.fp.read().count(b"\xff\xda") > BOUNDS.max_scans:
                    raise src.too_many("scans", BOUNDS.max_scans)
            return Probe("JPEG", width, height, reducible=not multi_scan)
        pos += 2 + length


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}


def _png(src: _Source, whole: bool, base: int = 0) -> Probe:
    """IHDR, then every chunk to IEND: Pillow reads each one (before the pixels and after them)."""
    length, kind, width, height = src.unpack(">I4sII", base + 8)
    if kind != b"IHDR" or length != 13 or not 0 < width < 2**31 or not 0 < height < 2**31:
        raise src.corrupt(f"first chunk {kind!r} of {length} bytes declares {width}x{height}")
    pos, profiles = base + 8, 0
    while pos + 12 <= src.size:  # a truncated file stops the walk; Pillow then names what is missing
        length, kind = src.unpack(">I4s", pos)
        src.block("chunks")
        if length >= 2**31:
            raise src.corrupt(f"chunk {kind!r} of {length} bytes")
        if kind == b"eXIf" and length > BOUNDS.max_exif_bytes:
            raise BadImage(f"PNG: an Exif block of {length:,} bytes (limit {BOUNDS.max_exif_bytes:,})")
        if kind == b"iCCP":  # before or after IDAT: Pillow inflates every one it meets, in open or in load
            profiles += 1
            if profiles > 1:
                raise BadImage(f"{src.fmt}: a second ICC profile (iCCP chunk at byte {pos}); the PNG specification "
                               "allows one, and Pillow inflates each: re-save it with one profile")
        if kind in _PNG_PACKED:
            src.packed += length
            src.packed_chunks += 1
            if src.packed_chunks > BOUNDS.max_png_packed_chunks:
                raise BadImage(f"{src.fmt}: more than {BOUNDS.max_png_packed_chunks} compressed metadata chunks "
                               "(iCCP, zTXt, iTXt), which Pillow inflates one by one before any pixel: "
                               "re-save it without them (a bound on the work of reading its header)")
            if src.packed > BOUNDS.max_png_packed_metadata:
                raise BadImage(f"{src.fmt}: more than {BOUNDS.max_png_packed_metadata:,} bytes of compressed "
                               "metadata (iCCP, zTXt, iTXt chunks), which Pillow inflates before any pixel: "
                               "re-save it without them (a bound on the work of reading its header)")
        if kind == b"IEND" or (kind == b"IDAT" and not whole):  # the scan reads what Image.open reads
            break
        pos += 12 + length
    return Probe("PNG", width, height)


_PNG_PACKED = {b"iCCP", b"zTXt", b"iTXt"}  # zlib-compressed chunks Pillow inflates (an ICC profile, text)


def _gif(src: _Source, whole: bool) -> Probe:
    """The logical screen and frame 0's extent: Pillow enlarges the screen to hold frame 0."""
    width, height, flags = src.unpack("<HHB", 6)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # after the global colour table
    while True:  # every block and sub-block counts
        src.block("blocks before the first image")
        intro = src.at(pos, 1)
        if intro == b",":
            x, y, w, h = src.unpack("<4H", pos + 1)
            width, height = max(width, x + w), max(height, y + h)
            if not width or not height:
                raise src.corrupt("an empty image")
            return Probe("GIF", width, height)
        if intro == b";":
            raise src.corrupt("no image before the end of the file")
        if intro == b"!":  # an extension: a label, then sub-blocks until a 0 length
            pos += 2
            while length := src.at(pos, 1)[0]:
                src.block("blocks before the first image")
                pos += 1 + length
            pos += 1
        else:
            pos += 1  # Pillow skips a stray byte between blocks


def _bmp_size(src: _Source, header: int) -> tuple[int, int]:
    """(width, height) of a BMP/DIB info header at `header`, read as Pillow reads them (a BMP file's, or one an
    ICO entry embeds); RLE8/RLE4 pixels are refused: Pillow's BmpRleDecoder runs in Python one byte per step,
    and pads every row to the full width (a 17 KB file stating 16 MP took 2.2 s)."""
    (hsize,) = src.unpack("<I", header)
    if hsize == 12:  # OS/2 core header: no compression field, always uncompressed
        return src.unpack("<HH", header + 4)
    if hsize not in (40, 52, 56, 64, 108, 124):
        raise src.corrupt(f"unknown info header size {hsize}")
    width, height, _, _, compression = src.unpack("<IIHHI", header + 4)
    if compression in _BMP_RLE:
        whose = "an embedded BMP's" if src.fmt == "ICO" else "its"
        raise BadImage(f"{src.fmt}: {whose} pixels are {_BMP_RLE[compression]}-compressed, which Pillow decodes in "
                       "Python one byte at a time (a few KB can cost seconds): re-save it uncompressed or as PNG")
    return width, 2**32 - height if height >> 24 == 0xFF else height  # a negative height: stored top-down


_BMP_RLE = {1: "RLE8", 2: "RLE4"}  # the info header's compression field


def _bmp(src: _Source, whole: bool) -> Probe:
    width, height = _bmp_size(src, 14)
    if not width or not height:
        raise src.corrupt(f"{width}x{height}")
    return Probe("BMP", width, height)


def _ico(src: _Source, whole: bool) -> Probe:
    """Every entry's embedded PNG or BMP, read from its own header: Pillow decodes one inside Image.open,
    chosen by the directory's sizes, which need not be the embedded image's. Entries may not share bytes (the
    directory's offset and size), and every walk of an embedded PNG draws on the one block budget of the file."""
    (count,) = src.unpack("<H", 4)
    if not 1 <= count <= BOUNDS.max_icon_entries:
        raise src.corrupt(f"{count} entries (1 to {BOUNDS.max_icon_entries} accepted)")
    side, largest = BOUNDS.max_icon_side, (0, 0)
    spans = sorted((*src.unpack("<II", 6 + 16 * i + 8)[::-1], i + 1) for i in range(count))  # (offset, size, entry)
    for (start, length, i), (later, _, j) in zip(spans, spans[1:]):
        if later < start + max(length, 1):  # the same image twice would be walked (and budgeted) twice
            raise BadImage(f"ICO: entries {min(i, j)} and {max(i, j)} share image bytes (entry {i} at byte {start}, "
                           f"{length:,} bytes; entry {j} at byte {later}): each entry embeds its own image")
    for i in range(count):
        (offset,) = src.unpack("<I", 6 + 16 * i + 12)
        if src.at(offset, 8) == _PNG_MAGIC:
            found = _png(src, whole, base=offset)
            kind, width, height = "PNG", found.width, found.height
        else:
            kind, (width, height) = "BMP", _bmp_size(src, offset)
            height //= 2  # an icon's BMP stores the colour image and its mask one above the other
        if not 0 < width <= side or not 0 < height <= side:
            raise BadImage(f"ICO: entry {i + 1} embeds a {width}x{height} {kind}; an icon image is at most "
                           f"{side}x{side} (its directory states the size, the embedded header is what decodes)")
        largest = max(largest[0], width), max(largest[1], height)
    return Probe("ICO", *largest)


def _tiff(src: _Source, whole: bool) -> Probe:
    """IFD 0, Pillow's frame 0: its entry count, the bytes its tags point to, the image and tile sizes, and
    the strip or tile layout (Pillow builds one Python tile per offset the directory lists)."""
    order = "<" if src.at(0, 2) == b"II" else ">"
    big = src.unpack(order + "H", 2)[0] == 43  # BigTIFF: 64-bit counts and offsets
    count_fmt, entry, inline = (order + "Q", 20, 8) if big else (order + "H", 12, 4)
    (ifd,) = src.unpack(order + ("Q" if big else "I"), 8 if big else 4)
    (count,) = src.unpack(count_fmt, ifd)
    if count > BOUNDS.max_tiff_tags:
        raise src.too_many("tags in its first directory", BOUNDS.max_tiff_tags)
    first = ifd + struct.calcsize(count_fmt)
    values, counts, total = {}, {}, 0
    for i in range(count):
        tag, typ, n = src.unpack(order + ("HHQ" if big else "HHI"), first + i * entry)
        size = n * _TIFF_TYPES.get(typ, 0)
        if size > inline:
            total += size
        if tag in _TIFF_LAYOUT_TAGS:
            counts.setdefault(tag, n)  # checked against the layout below
        elif n > BOUNDS.max_tiff_numbers and typ not in _TIFF_BYTES:  # Pillow makes a tuple of numbers
            raise BadImage(f"TIFF: tag {tag} holds {n:,} numbers (limit {BOUNDS.max_tiff_numbers:,})")
        if tag in _TIFF_SIZE_TAGS and tag not in values:  # Pillow keeps a repeated tag's first entry
            if n != 1 or typ not in (3, 4, 16):
                raise src.corrupt(f"tag {tag} holds {n} values of type {typ}")
            field = {3: "H", 4: "I", 16: "Q"}[typ]
            values[tag] = src.unpack(order + field, first + i * entry + entry - inline)[0]
    if total > BOUNDS.max_tiff_values:
        raise BadImage(f"TIFF: its first directory points to {total:,} bytes of tag values "
                       f"(limit {BOUNDS.max_tiff_values:,})")
    width, height = values.get(256, 0), values.get(257, 0)
    if not width or not height:
        raise src.corrupt(f"image size {width}x{height}")
    tile = values.get(322, 0) * values.get(323, 0)
    if tile > max(width * height, BOUNDS.max_tiff_tile):
        raise BadImage(f"TIFF: a {values[322]}x{values[323]} tile for a {width}x{height} image")
    if values.get(277, 1) > BOUNDS.max_components + 2:  # Pillow decodes up to RGBA plus extra samples
        raise src.corrupt(f"{values[277]} samples per pixel")
    _tiff_layout(src, width, height, values, counts)
    return Probe("TIFF", width, height)


def _tiff_layout(src: _Source, width: int, height: int, values: dict[int, int], counts: dict[int, int]) -> None:
    """The offsets and byte counts list exactly one entry per strip or tile of the image (per plane when
    PlanarConfiguration is 2), as the TIFF specification states: Pillow builds a tile per offset whatever the
    image's size (a 1x2 image listing a million strips took 8 s and 250 MB), and libtiff counts them the same way."""
    planes = values.get(277, 1) if values.get(284, 1) == 2 else 1
    if 324 in counts or 322 in values or 323 in values:
        if 273 in counts:
            raise src.corrupt("both strip offsets and tiles")
        tile_w, tile_h = values.get(322, 0), values.get(323, 0)
        if not tile_w or not tile_h:
            raise src.corrupt(f"tiles of {tile_w}x{tile_h}")
        blocks, what = -(-width // tile_w) * -(-height // tile_h) * planes, f"{tile_w}x{tile_h} tiles"
        offsets, sizes = 324, 325
    else:
        rows = values.get(278, height)  # RowsPerStrip: 2**32-1 (all rows) is common
        if not rows:
            raise src.corrupt("0 rows per strip")
        blocks, what = -(-height // rows) * planes, f"strips of {min(rows, height)} rows"
        offsets, sizes = 273, 279
    over = "" if planes == 1 else f" over {planes} planes"
    if blocks > BOUNDS.max_tiff_blocks:
        raise BadImage(f"TIFF: its {width}x{height} image is stored as {blocks:,} {what}{over} "
                       f"(limit {BOUNDS.max_tiff_blocks:,})")
    for tag, name in ((offsets, "offsets"), (sizes, "byte counts")):
        if counts.get(tag, blocks) != blocks:
            raise src.corrupt(f"{counts[tag]:,} {name} for a {width}x{height} image in {what}{over}, "
                              f"which has {blocks:,}")
    if offsets not in counts:
        raise src.corrupt("no strip or tile offsets")


_TIFF_TYPES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}
# width, length, samples per pixel, rows per strip, planar configuration, tile width, tile length
_TIFF_SIZE_TAGS = {256, 257, 277, 278, 284, 322, 323}
_TIFF_LAYOUT_TAGS = {273, 279, 324, 325}  # strip offsets, strip byte counts, tile offsets, tile byte counts
_TIFF_BYTES = {1, 2, 7}  # BYTE, ASCII, UNDEFINED: Pillow keeps them as one bytes or str object


def _webp(src: _Source, whole: bool) -> Probe:
    """The canvas (VP8X) or the one bitstream's size; bitstreams and animation frames must lie inside the canvas,
    as libwebp's demuxer requires too (its decoder allocates the whole canvas when created, inside Image.open)."""
    if src.at(8, 4) != b"WEBP":
        raise BadImage(f"not an image (a RIFF file that is not WebP; accepted: {', '.join(ALLOWED_FORMATS)})")
    pos, canvas = 12, None
    while pos + 8 <= src.size:
        kind, length = src.unpack("<4sI", pos)
        src.block("chunks")
        size = None
        if kind == b"VP8X" and pos == 12:
            canvas = _le(src.at(pos + 12, 3)) + 1, _le(src.at(pos + 15, 3)) + 1
        elif kind == b"VP8 ":
            if src.at(pos + 11, 3) != b"\x9d\x01\x2a":
                raise src.corrupt("a VP8 bitstream without its start code")
            w, h = src.unpack("<HH", pos + 14)
            size = (w & 0x3FFF, h & 0x3FFF)
        elif kind == b"VP8L":
            bits = _le(src.at(pos + 9, 4))
            size = ((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
        elif kind == b"ANMF":  # x/2, y/2, width-1, height-1
            x, y, w, h = (_le(src.at(pos + 8 + k, 3)) for k in (0, 3, 6, 9))
            size = (2 * x + w + 1, 2 * y + h + 1)
        elif kind == b"EXIF" and length > BOUNDS.max_exif_bytes:
            raise BadImage(f"WEBP: an Exif block of {length:,} bytes (limit {BOUNDS.max_exif_bytes:,})")
        if size is not None and canvas is None:
            canvas = size
        elif size is not None and (size[0] > canvas[0] or size[1] > canvas[1]):
            raise BadImage(f"WEBP: a {kind.decode().strip()} image reaching {size[0]}x{size[1]} outside its "
                           f"{canvas[0]}x{canvas[1]} canvas")
        pos += 8 + length + (length & 1)
    if canvas is None or not canvas[0] or not canvas[1]:
        raise src.corrupt(f"no image size (no VP8X, VP8 or VP8L chunk, or an empty one: {canvas})")
    return Probe("WEBP", *canvas)


def _le(b: bytes) -> int:
    return int.from_bytes(b, "little")


def _ppm(src: _Source, whole: bool) -> Probe:
    """P4-P6: magic, width, height (and maxval, but for P4) as Pillow tokenises them (a '#' comment may end
    anywhere, even mid-token), within a bounded header: Pillow reads a comment a byte at a time, however long.
    Plain (ASCII) P1-P3 are refused: Pillow's PpmPlainDecoder strips each comment in the pixel data by rebuilding
    its 1 MiB block (a 1x1 image followed by 1 MiB of comments took 12 s)."""
    head = src.at(0, min(src.size, BOUNDS.max_ppm_header))
    pos, tokens, magic = 3, [], head[:2]
    if head[2:3] not in b" \t\n\v\f\r" or not head[2:3]:
        raise BadImage(f"not an image (unrecognised format; accepted: {', '.join(ALLOWED_FORMATS)})")
    if magic in (b"P1", b"P2", b"P3"):
        raise BadImage(f"PPM: a plain (ASCII) {magic.decode()} file, which Pillow decodes in Python at a cost that "
                       "grows with the square of its comments: convert it to binary PNM (P4-P6) or PNG")
    wanted = 2 if magic == b"P4" else 3  # a bitmap has no maxval
    token = b""
    while len(tokens) < wanted:
        if pos >= len(head):
            what = "width and height" if len(tokens) < 2 else "maxval"
            raise src.corrupt(f"no {what} in its first {BOUNDS.max_ppm_header:,} bytes")
        c = head[pos:pos + 1]
        pos += 1
        if c == b"#":
            ends = [i for i in (head.find(b"\r", pos), head.find(b"\n", pos)) if i >= 0]
            pos = min(ends) + 1 if ends else len(head)
        elif c in b" \t\n\v\f\r":
            if token:
                tokens.append(token)
                token = b""
        else:
            token += c
            if len(token) > 10:
                raise src.corrupt("a token longer than 10 characters")
    try:
        width, height, maxval = (int(t) for t in tokens + [b"1"] * (3 - len(tokens)))
    except ValueError:
        raise src.corrupt(f"size and maxval {b' '.join(tokens)!r}") from None
    if width <= 0 or height <= 0:
        raise src.corrupt(f"{width}x{height}")
    if not 0 < maxval < 65536:
        raise src.corrupt(f"maxval {maxval}")
    samples = width * height * (3 if magic == b"P6" else 1)
    native = magic == b"P4" or maxval == 255 or (maxval == 65535 and magic == b"P5")
    if not native and samples > BOUNDS.max_ppm_python_samples:
        raise BadImage(f"PPM: a {width}x{height} {magic.decode()} with maxval {maxval}: Pillow converts each of its "
                       f"{samples:,} samples in Python (more than {BOUNDS.max_ppm_python_samples:,}; only maxval 255, "
                       "or 65535 in a P5, decodes natively): convert it to PNG")
    return Probe("PPM", width, height)


_FORMATS = (
    ((b"\xff\xd8\xff",), "JPEG", _jpeg),
    ((_PNG_MAGIC,), "PNG", _png),
    ((b"GIF87a", b"GIF89a"), "GIF", _gif),
    ((b"BM",), "BMP", _bmp),
    ((b"II*\0", b"MM\0*", b"II+\0", b"MM\0+"), "TIFF", _tiff),
    ((b"RIFF",), "WEBP", _webp),
    ((b"P1", b"P2", b"P3", b"P4", b"P5", b"P6"), "PPM", _ppm),
    ((b"\0\0\1\0",), "ICO", _ico),
)
ALLOWED_FORMATS = tuple(dict.fromkeys(fmt for _, fmt, _ in _FORMATS))


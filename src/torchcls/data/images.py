"""Decode one image file into a uint8 CxHxW tensor with a defined outcome for every odd case.

Handled by conversion: EXIF orientation, palette, RGBA/LA (composited on white),
CMYK/YCbCr/LAB, 1-bit, 16/32-bit integer and float greyscale. Handled by reduced decoding:
JPEGs far larger than the model's input (the JPEG decoder scales by 1/2, 1/4 or 1/8).
Reported as a bad file (`BadImage`, with the reason): zero-byte, non-image, a format outside the
allow-list, truncated/corrupted, images above the --max-pixels limit that cannot be decoded reduced,
and images whose resize to the model's input would allocate more than `RESIZE_LIMIT`.

Bounded before built: `image_formats.probe` names the format from the bytes and reads every size
the file declares (each embedded image of a container, frame 0's extent) with bounded counts;
`plan_decode` decides from those sizes, and only then does Pillow see the bytes, restricted to the
format named, and decode frame 0 alone. The start-up scan (`read_header`) reads the same header
the same way, so it refuses what the decoder would (except what only decoding reads: a progressive
JPEG's scan count, and its stored size above --max-pixels). Every bound is in `image_formats.Bounds`.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import struct
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from torchcls.data.image_formats import ALLOWED_FORMATS, BOUNDS, BadImage, Probe, probe
from torchcls.errors import UserError
from torchcls.io_files import kind_of, open_fd

__all__ = ["ALLOWED_FORMATS", "MAX_PIXELS", "RESIZE_LIMIT", "BadImage", "decode_bytes", "load_image",
           "decode_to_pil", "normalize_mode", "plan_decode", "probe_bytes",
           "read_header", "read_image_file"]

# 64 MP: above any photo a classifier needs; the default of --max-pixels.
MAX_PIXELS = BOUNDS.max_pixels
# Resize(short side -> img_size) of a 2,000,000x4 strip would allocate gigabytes: refuse any
# image whose resized copy exceeds this many pixels (at 224 px: aspect ratios beyond ~1:330).
RESIZE_LIMIT = BOUNDS.resize_limit
# What Pillow raises on a malformed file once `probe` has bounded it: OSError (its decoders' errors), SyntaxError
# and ValueError (its parsers'), EOFError (a frame that is not there), and the three that Image.open itself
# takes for "cannot identify" when a plugin raises them (IndexError, TypeError, struct.error). 4,000 fuzzed
# files (tests/test_image_fuzz.py's strategy) raised nothing outside the first three.
_DECODER_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error)


def _stored_bound(max_pixels: int) -> int | None:
    """The most pixels a file accepted under `max_pixels` may store (None: no limit): a one-scan JPEG
    decoded reduced stores up to `reduced_jpeg_factor` times what is decoded."""
    return max_pixels * BOUNDS.reduced_jpeg_factor if max_pixels else None


# Pillow's own decompression-bomb check, on at the project's bound: Image.open refuses (DecompressionBombError)
# any image storing more than twice this and warns above it; `probe` and `plan_decode` have refused anything
# above it before Pillow is called, so Pillow's check is the second line, for a size our reader missed.
Image.MAX_IMAGE_PIXELS = _stored_bound(MAX_PIXELS)
_pillow_lock = threading.Lock()


def _let_pillow_allow(max_pixels: int) -> None:
    """Raise Pillow's process-wide bound to admit what a call with `max_pixels` accepts (a user's higher
    --max-pixels, or 0 = none), never lower it: a lower value would refuse another, concurrent call's
    accepted image (serve decodes in threads). Each call's own limit is applied per call by plan_decode,
    so the most permissive limit asked in this process relaxes only Pillow's second line, never a call's."""
    bound, current = _stored_bound(max_pixels), Image.MAX_IMAGE_PIXELS
    if current is None or (bound is not None and bound <= current):
        return
    with _pillow_lock:
        if Image.MAX_IMAGE_PIXELS is not None:
            Image.MAX_IMAGE_PIXELS = None if bound is None else max(bound, Image.MAX_IMAGE_PIXELS)


def plan_decode(fmt: str | None, width: int, height: int, min_side: int | None = None,
                max_pixels: int = MAX_PIXELS, *, reducible: bool | None = None) -> int:
    """The JPEG DCT scale (1, 2, 4 or 8) to decode at, or BadImage if the image must be refused.

    `min_side`: the shortest side the transform needs (None: decode at full size, no resize check).
    `reducible`: a JPEG that libjpeg decodes reduced in one streaming pass (`Probe.reducible`; None: any
    JPEG). A progressive or multi-scan JPEG is decoded from every coefficient of the full image, so its
    stored size is held to --max-pixels too; a one-scan JPEG may store `reduced_jpeg_factor` times more.
    """
    short, long = min(width, height), max(width, height)
    if short <= 0:
        raise BadImage(f"{width}x{height}: empty image")
    if min_side:
        resized = math.ceil(long * min_side / short) * min_side
        if resized > RESIZE_LIMIT:
            raise BadImage(f"{width}x{height} pixels (aspect ratio 1:{long / short:.0f}): resizing it to "
                           f"{min_side} px on its short side would allocate {resized:,} pixels (limit "
                           f"{RESIZE_LIMIT:,}); crop it into tiles first")
    scale = 1
    if fmt == "JPEG" and min_side:
        while scale < 8 and short // (scale * 2) >= min_side:
            scale *= 2
    decoded = math.ceil(width / scale) * math.ceil(height / scale)
    if max_pixels and decoded > max_pixels:
        raise BadImage(f"{width}x{height} = {width * height:,} pixels is above the --max-pixels limit of "
                       f"{max_pixels:,} (a guard against decompression bombs); raise --max-pixels "
                       "(0 = no limit) or downscale the file")
    one_pass = fmt == "JPEG" and (reducible is None or reducible)
    stored_limit = _stored_bound(max_pixels) if one_pass else max_pixels
    if stored_limit and width * height > stored_limit:
        why = (f"{BOUNDS.reduced_jpeg_factor} x --max-pixels, for a JPEG decoded reduced" if one_pass else
               "--max-pixels: a progressive or multi-scan JPEG is decoded from every coefficient of the full image")
        raise BadImage(f"{width}x{height} = {width * height:,} pixels is above {stored_limit:,} ({why}); raise "
                       "--max-pixels (0 = no limit) or downscale the file")
    return scale


def _to_8bit(im: Image.Image) -> Image.Image:
    """16/32-bit integer or float greyscale -> 8-bit, by the range its mode can hold.

    Integer arithmetic in uint32 (float32 for 'F'): no float64 copy of a whole large image."""
    arr = np.asarray(im)
    if im.mode == "F":
        top = 1.0 if arr.max(initial=0) <= 1.0 else 255.0
        out = np.clip(arr, 0.0, top).astype(np.float32, copy=False) * np.float32(255.0 / top)
        return Image.fromarray(np.rint(out, out=out).astype(np.uint8), mode="L")
    # 'I;16*' is 16-bit by definition; 'I' from a 16-bit PNG also holds 0..65535.
    if im.mode.startswith("I;16") or arr.max(initial=0) > 255:
        wide = np.clip(arr, 0, 65535).astype(np.uint32)
        wide *= 255
        wide += 32767  # round to nearest: (v * 255 + 65535 // 2) // 65535
        wide //= 65535
        return Image.fromarray(wide.astype(np.uint8), mode="L")
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), mode="L")


def _flatten_alpha(im: Image.Image) -> Image.Image:
    rgba = im.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def normalize_mode(im: Image.Image, channels: int) -> Image.Image:
    """Any PIL mode -> 'L' (channels=1) or 'RGB' (channels=3)."""
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        im = _to_8bit(im)
    elif im.mode == "P":
        im = _flatten_alpha(im) if "transparency" in im.info else im.convert("RGB")
    elif im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        im = _flatten_alpha(im)
    elif im.mode not in ("L", "RGB"):
        im = im.convert("RGB")  # CMYK, YCbCr, LAB, HSV, 1
    return im.convert("L" if channels == 1 else "RGB")


def _turbo_decoder():
    """torchvision's libjpeg-turbo decode_jpeg, or None where this torchvision no longer has it."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None
    return decode_jpeg, ImageReadMode


def _decode_turbo(data: bytes, channels: int) -> torch.Tensor | None:
    # libjpeg-turbo through torchvision: ~1.6 ms vs Pillow's ~2.6 ms for a 500x375 JPEG here.
    # torchvision 0.29 deprecates its decoders in favour of torchcodec (not installed here):
    # silenced, and the caller falls back to Pillow once they are gone.
    found = _turbo_decoder()
    if found is None:
        return None
    decode_jpeg, read_mode = found
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return decode_jpeg(encoded, mode=read_mode.GRAY if channels == 1 else read_mode.RGB,
                               apply_exif_orientation=True)
    except RuntimeError as e:
        raise BadImage(f"truncated or corrupted: {str(e).rsplit(', ', 1)[-1]}") from None


def _check_entry(path: Path) -> None:
    """The reasons a path is no image file at all, named before trying to open it."""
    if path.is_symlink() and not path.exists():
        raise BadImage(f"broken symlink (points to {os.readlink(path)}, which does not exist)")
    if path.is_dir():
        raise BadImage("a directory, not an image file")


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    """(file, size) of `path` through io_files (a regular file only, never a blocking open, decided on the open
    descriptor); what it refuses is a bad file here, skippable like any other."""
    with _entry_errors():
        _check_entry(path)
        try:
            fd = open_fd(path, what="image file")
        except UserError:
            kind = kind_of(os.stat(path).st_mode) if os.path.exists(path) else "not a regular file"
            raise BadImage(f"{kind}, not a regular file: only regular files are read as images") from None
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if size == 0:
                raise BadImage("empty file (0 bytes)")
            if size > BOUNDS.max_file_bytes:  # read whole to decode (a sparse file costs nothing on disk)
                raise _too_large(size)
            yield f, size


def _too_large(size: int) -> BadImage:
    return BadImage(f"too large to read: {size:,} bytes, and an image is read whole to be decoded, at most "
                    f"{BOUNDS.max_file_bytes:,} bytes (image_formats.Bounds.max_file_bytes)")


def load_image(path: str | Path, channels: int, min_side: int | None = None,
               max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """Decode the file `path` to a uint8 tensor of shape (channels, H, W), or raise BadImage
    (see `decode_bytes`; here also: missing, unreadable, a directory, a broken symlink, not a regular file)."""
    return decode_bytes(read_image_file(path), channels, min_side, max_pixels)


def read_image_file(path: str | Path) -> bytes:
    """The bytes of the regular file `path`, or BadImage naming why not (missing, unreadable, a directory,
    a broken symlink, a pipe or device, empty)."""
    try:
        with _open_regular(Path(path)) as (f, _):
            data = f.read(BOUNDS.max_file_bytes + 1)  # the size was checked on open; the file may grow since
    except OSError as e:  # anything else the disk says (EIO...): still a named bad file, not a crash
        raise BadImage(f"unreadable: {e}") from None
    if len(data) > BOUNDS.max_file_bytes:
        raise _too_large(len(data))  # (it grew after it was opened)
    return data


@contextlib.contextmanager
def _entry_errors() -> Iterator[None]:
    """What reaching a file can go wrong with, as BadImage reasons (shared by load_image and read_header)."""
    try:
        yield
    except BadImage:
        raise
    except FileNotFoundError:
        raise BadImage("file not found") from None
    except PermissionError:
        raise BadImage("permission denied (not readable by this user)") from None
    except IsADirectoryError:
        raise BadImage("a directory, not an image file") from None


@contextlib.contextmanager
def _pillow(data: bytes, found: Probe, max_pixels: int) -> Iterator[Image.Image]:
    """Pillow's image of `data`, opened as the one format `probe` named (no other plugin parses the bytes);
    whatever Pillow raises on a malformed file, while opening or decoding in the caller's block, is BadImage."""
    _let_pillow_allow(max_pixels)
    try:
        with Image.open(io.BytesIO(data), formats=[found.format]) as im:
            if im.width > found.width or im.height > found.height:
                raise BadImage(f"{found.format}: its header reads {found.width}x{found.height} here but "
                               f"{im.width}x{im.height} to Pillow: refused as malformed")
            yield im
    except BadImage:
        raise
    except Image.DecompressionBombError as e:
        raise BadImage(f"too large, possible decompression bomb: {e}") from None
    except UnidentifiedImageError:
        raise BadImage(f"truncated or corrupted: Pillow's {found.format} reader cannot open it") from None
    except _DECODER_ERRORS as e:
        raise BadImage(f"truncated or corrupted: {e or type(e).__name__}") from None


def probe_bytes(data: bytes) -> Probe:
    """The format `data` holds (named from its bytes) and every size in it, or BadImage: no Pillow involved."""
    if not data:
        raise BadImage("empty file (0 bytes)")
    if len(data) > BOUNDS.max_file_bytes:  # the same bound for bytes from a shard, a table or an upload
        raise _too_large(len(data))
    return probe(io.BytesIO(data), len(data))


# EXIF orientation -> the transpose that displays the image upright (as ImageOps.exif_transpose maps it,
# without its rewriting of the metadata, which a tensor does not keep).
_UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}


def _upright(im: Image.Image) -> Image.Image:
    method = _UPRIGHT.get(im.getexif().get(0x0112, 1))
    return im if method is None else im.transpose(method)


def decode_bytes(data: bytes, channels: int, min_side: int | None = None,
                 max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """Encoded image bytes (a file's, a shard member's, an Arrow cell's, an upload's) -> uint8
    (channels, H, W), or BadImage with the reason. The one decoder: every path gets the format
    allow-list, the size checks from the header, reduced JPEG decoding and libjpeg-turbo.

    `min_side`: the shortest side the transform needs; big JPEGs are decoded reduced to the
    smallest DCT scale still at least that size, and extreme aspect ratios are refused."""
    found = probe_bytes(data)  # the format from the bytes, and every size in them, before Pillow
    scale = plan_decode(found.format, found.width, found.height, min_side, max_pixels, reducible=found.reducible)
    with _pillow(data, found, max_pixels) as im:
        if found.format == "JPEG" and scale == 1 and im.mode in ("RGB", "L", "CMYK"):
            decoded = _decode_turbo(data, channels)
            if decoded is not None:
                return decoded
        if scale > 1:
            im.draft("L" if channels == 1 else "RGB", (im.width // scale, im.height // scale))
        im.load()  # frame 0, the only one ever decoded: a truncated file fails here with its reason
        arr = np.asarray(normalize_mode(_upright(im), channels))
    tensor = torch.from_numpy(arr.copy())
    return tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1).contiguous()


def decode_to_pil(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """A loaded, upright PIL image of `data` at full size, after the checks `decode_bytes` makes: for code that
    needs Pillow's image itself (the governance "file" hooks) rather than a tensor."""
    found = probe_bytes(data)
    plan_decode(found.format, found.width, found.height, None, max_pixels, reducible=found.reducible)
    with _pillow(data, found, max_pixels) as im:
        im.load()
        return ImageOps.exif_transpose(im)  # and the orientation tag goes, so no hook turns it twice


def read_header(path: Path) -> tuple[str, int, int]:
    """(format, width, height) from the header alone, never the pixels and never Pillow: `probe` reads the
    sizes decode_bytes will check (each ICO entry's embedded image included); BadImage if unidentifiable."""
    try:
        with _open_regular(Path(path)) as (f, size):
            found = probe(f, size, whole=False)
    except OSError as e:
        raise BadImage(f"unreadable: {e}") from None
    return found.format, found.width, found.height

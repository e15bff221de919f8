"""Decode one image file into a uint8 CxHxW tensor with a defined outcome for every odd case.

Handled by conversion: EXIF orientation, palette, RGBA/LA (composited on white),
CMYK/YCbCr/LAB, 1-bit, 16/32-bit integer and float greyscale. Handled by reduced decoding:
JPEGs far larger than the model's input (the JPEG decoder scales by 1/2, 1/4 or 1/8).
Reported as a bad file (`BadImage`, with the reason): zero-byte, non-image,
truncated/corrupted, images above the --max-pixels limit that cannot be decoded reduced,
and images whose resize to the model's input would allocate more than `RESIZE_LIMIT`.

Every size check is decided from the header (`plan_decode`), before any pixel is decoded,
so the start-up scan and the decoder in training, predict and serve refuse the same files.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# 64 MP: above any photo a classifier needs; the default of --max-pixels.
MAX_PIXELS = 64_000_000
# Resize(short side -> img_size) of a 2,000,000x4 strip would allocate gigabytes: refuse any
# image whose resized copy exceeds this many pixels (at 224 px: aspect ratios beyond ~1:330).
RESIZE_LIMIT = 16_000_000
# Formats Pillow may open: raster formats with decoders inside Pillow. Never EPS/PS/PDF-like
# plugins (EPS starts Ghostscript on the file), nor rarely used plugins whose parsers see little
# hostile input. Multi-picture JPEGs (MPO) open through the JPEG entry.
ALLOWED_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "DIB", "TIFF", "WEBP", "PPM", "ICO", "TGA", "QOI")
# Our own checks replace Pillow's global bomb limit, which cannot be set per call and would
# refuse the big JPEGs that draft mode decodes reduced.
Image.MAX_IMAGE_PIXELS = None


class BadImage(Exception):
    """An image file that cannot become a tensor; str() is the reason."""


def plan_decode(fmt: str | None, width: int, height: int, min_side: int | None = None,
                max_pixels: int = MAX_PIXELS) -> int:
    """The JPEG DCT scale (1, 2, 4 or 8) to decode at, or BadImage if the image must be refused.

    `min_side`: the shortest side the transform needs (None: decode at full size, no resize check).
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
    if path.stat().st_size == 0:
        raise BadImage("empty file (0 bytes)")


def load_image(path: str | Path, channels: int, min_side: int | None = None,
               max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """Decode the file `path` to a uint8 tensor of shape (channels, H, W), or raise BadImage
    (see `decode_bytes`; here also: missing, unreadable, a directory, a broken symlink)."""
    path = Path(path)
    try:
        with _entry_errors():
            _check_entry(path)
            data = path.read_bytes()
    except OSError as e:  # anything else the disk says (EIO...): still a named bad file, not a crash
        raise BadImage(f"unreadable: {e}") from None
    return decode_bytes(data, channels, min_side, max_pixels)


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


def decode_bytes(data: bytes, channels: int, min_side: int | None = None,
                 max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """Encoded image bytes (a file's, a shard member's, an Arrow cell's, an upload's) -> uint8
    (channels, H, W), or BadImage with the reason. The one decoder: every path gets the format
    allow-list, the size checks from the header, reduced JPEG decoding and libjpeg-turbo.

    `min_side`: the shortest side the transform needs; big JPEGs are decoded reduced to the
    smallest DCT scale still at least that size, and extreme aspect ratios are refused."""
    if not data:
        raise BadImage("empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as im:
            scale = plan_decode(im.format, im.width, im.height, min_side, max_pixels)
            if im.format == "JPEG" and scale == 1 and im.mode in ("RGB", "L", "CMYK"):
                decoded = _decode_turbo(data, channels)
                if decoded is not None:
                    return decoded
            if scale > 1:
                im.draft("L" if channels == 1 else "RGB", (im.width // scale, im.height // scale))
            im.load()  # decode everything now: a truncated file fails here with its reason
            im = ImageOps.exif_transpose(im)
            im = normalize_mode(im, channels)
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage(f"not an image (unrecognised format; accepted: {', '.join(ALLOWED_FORMATS)})") from None
    except Image.DecompressionBombError as e:
        raise BadImage(f"too large, possible decompression bomb: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise BadImage(f"truncated or corrupted: {e}") from None
    arr = np.asarray(im)
    tensor = torch.from_numpy(arr.copy())
    return tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1).contiguous()


def read_header(path: Path) -> tuple[str, int, int]:
    """(format, width, height) from the header alone, never the pixels; BadImage if unidentifiable."""
    try:
        with _entry_errors():
            _check_entry(path)
            with Image.open(path, formats=ALLOWED_FORMATS) as im:
                return im.format or "?", im.width, im.height
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage(f"not an image (unrecognised format; accepted: {', '.join(ALLOWED_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise BadImage(f"truncated or corrupted header: {e}") from None

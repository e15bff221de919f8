"""Decode one image file into a uint8 CxHxW tensor with a defined outcome for every odd case.

Handled by conversion: EXIF orientation, palette, RGBA/LA (composited on white),
CMYK/YCbCr/LAB, 1-bit, 16/32-bit integer and float greyscale. Reported as a bad file
(`BadImage`, with the reason): zero-byte, non-image, truncated/corrupted, and images
above `MAX_PIXELS` (decompression bombs).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# 64 MP: above any photo a classifier needs; a larger image is treated as a decompression bomb.
MAX_PIXELS = 64_000_000


class BadImage(Exception):
    """An image file that cannot become a tensor; str() is the reason."""


def _to_8bit(im: Image.Image) -> Image.Image:
    """16/32-bit integer or float greyscale → 8-bit, by the range its mode can hold."""
    arr = np.asarray(im)
    if im.mode == "F":
        scaled = np.clip(arr, 0.0, 1.0) * 255.0 if arr.max(initial=0) <= 1.0 else np.clip(arr, 0, 255)
    else:
        # 'I;16*' is 16-bit by definition; 'I' from a 16-bit PNG also holds 0..65535.
        top = 65535.0 if im.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        scaled = arr.astype(np.float64) * (255.0 / top)
    return Image.fromarray(np.round(scaled).astype(np.uint8), mode="L")


def _flatten_alpha(im: Image.Image) -> Image.Image:
    rgba = im.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def normalize_mode(im: Image.Image, channels: int) -> Image.Image:
    """Any PIL mode → 'L' (channels=1) or 'RGB' (channels=3)."""
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        im = _to_8bit(im)
    elif im.mode == "P":
        im = _flatten_alpha(im) if "transparency" in im.info else im.convert("RGB")
    elif im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        im = _flatten_alpha(im)
    elif im.mode not in ("L", "RGB"):
        im = im.convert("RGB")  # CMYK, YCbCr, LAB, HSV, 1
    return im.convert("L" if channels == 1 else "RGB")


def load_image(path: str | Path, channels: int) -> torch.Tensor:
    """Fully decode `path` to a uint8 tensor of shape (channels, H, W), or raise BadImage."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise BadImage("empty file (0 bytes)")
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                if im.width * im.height > MAX_PIXELS:
                    raise BadImage(f"{im.width}x{im.height} pixels is above the {MAX_PIXELS:,}-pixel limit "
                                   "(possible decompression bomb); downscale it first")
                im.load()  # decode everything now: truncated files fail here, not in a worker later
                im = ImageOps.exif_transpose(im)
                im = normalize_mode(im, channels)
    except BadImage:
        raise
    except FileNotFoundError:
        raise BadImage("file not found") from None
    except UnidentifiedImageError:
        raise BadImage("not an image (unrecognised format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImage(f"too large, possible decompression bomb: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise BadImage(f"truncated or corrupted: {e}") from None
    arr = np.asarray(im)
    tensor = torch.from_numpy(arr.copy())
    return tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1).contiguous()

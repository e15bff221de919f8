"""Built-in hooks: EXIF/GPS stripping (file stage) and sample redaction (output stage)."""

from __future__ import annotations

from PIL import Image, ImageOps

from torchcls.governance.hooks import OutputItem, SampleInfo, hook, redacted


@hook("strip-exif", "file")
def strip_exif(im: Image.Image, info: SampleInfo) -> Image.Image:
    """A copy with only the pixels: EXIF (GPS, camera, time), XMP, ICC and text chunks are dropped.

    The EXIF orientation is applied first, so the model sees the same upright image as without
    the hook; the copy is rebuilt from raw pixels, so no metadata can ride along.
    """
    im = ImageOps.exif_transpose(im)
    clean = Image.frombytes(im.mode, im.size, im.tobytes())
    if im.mode == "P":
        clean.putpalette(im.getpalette())
        if "transparency" in im.info:  # part of the pixels' meaning, not metadata
            clean.info["transparency"] = im.info["transparency"]
    return clean


@hook("redact-samples", "output")
def redact_samples(item: OutputItem) -> OutputItem:
    """Restricted samples: images become a flat grey tile, file names become a hash prefix."""
    if not item.sample.restricted:
        return item
    if item.kind == "sample_image":
        import torch

        return redacted(item, torch.full_like(item.value, 128))
    tag = item.sample.sha256[:16] if item.sample.sha256 else f"#{item.sample.index}"
    return redacted(item, f"[redacted sample sha256:{tag}]")

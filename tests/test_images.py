"""Every odd image file has a defined outcome: converted correctly, or a BadImage with the reason."""

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchcls.data.images import MAX_PIXELS, BadImage, load_image, plan_decode


def _save(tmp_path: Path, name: str, im: Image.Image, **kw) -> Path:
    p = tmp_path / name
    im.save(p, **kw)
    return p


def test_rgb_and_grey_conversion(tmp_path):
    p = _save(tmp_path, "a.png", Image.new("RGB", (5, 4), (255, 0, 0)))
    rgb = load_image(p, 3)
    assert rgb.shape == (3, 4, 5) and rgb.dtype == torch.uint8 and rgb[0].max() == 255 and rgb[1].max() == 0
    grey = load_image(p, 1)
    assert grey.shape == (1, 4, 5) and int(grey[0, 0, 0]) == 76  # ITU-R 601 luma of pure red
    g = _save(tmp_path, "g.png", Image.new("L", (3, 3), 200))
    assert load_image(g, 3).shape == (3, 3, 3) and load_image(g, 3).unique().tolist() == [200]


def test_cmyk_jpeg(tmp_path):
    p = _save(tmp_path, "c.jpg", Image.new("CMYK", (8, 8), (0, 255, 255, 0)))  # red in CMYK
    t = load_image(p, 3)
    assert t.shape == (3, 8, 8) and t[0].float().mean() > 200 and t[1].float().mean() < 60


def test_16bit_greyscale_is_scaled_not_clipped(tmp_path):
    arr = np.full((4, 4), 32768, dtype=np.uint16)
    p = _save(tmp_path, "d.png", Image.fromarray(arr))
    t = load_image(p, 1)
    assert int(t[0, 0, 0]) == 128


def test_palette_with_transparency_and_rgba_on_white(tmp_path):
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # fully transparent black → white
    assert load_image(_save(tmp_path, "t.png", rgba), 3).unique().tolist() == [255]
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([10, 20, 30] + [0] * 765)
    assert load_image(_save(tmp_path, "p.png", pal), 3)[:, 0, 0].tolist() == [10, 20, 30]
    pal.info["transparency"] = 0
    assert load_image(_save(tmp_path, "pt.png", pal, transparency=0), 3).unique().tolist() == [255]


def test_exif_rotation_applied(tmp_path):
    im = Image.new("RGB", (6, 2), (0, 0, 255))
    exif = im.getexif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    p = tmp_path / "r.jpg"
    im.save(p, exif=exif)
    assert load_image(p, 3).shape == (3, 6, 2)
    from PIL import ImageOps

    from torchcls.data.images import decode_to_pil
    upright = decode_to_pil(p.read_bytes())  # what the governance "file" hooks receive
    assert upright.size == (2, 6) and ImageOps.exif_transpose(upright).size == (2, 6)  # turned once, not twice


@pytest.mark.parametrize("name, content, reason", [
    ("empty.png", b"", "empty file"),
    ("notes.png", b"this is not an image at all", "not an image"),
])
def test_unreadable_bytes(tmp_path, name, content, reason):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(BadImage, match=reason):
        load_image(p, 3)


def test_truncated_and_corrupted(tmp_path):
    good = _save(tmp_path, "ok.jpg", Image.effect_noise((64, 64), 50).convert("RGB"))
    data = good.read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadImage, match="truncated or corrupted"):
        load_image(tmp_path / "trunc.jpg", 3)
    png = _save(tmp_path, "ok.png", Image.effect_noise((64, 64), 50))
    raw = bytearray(png.read_bytes())
    raw[60:90] = b"\x00" * 30  # smash the compressed stream
    (tmp_path / "bad.png").write_bytes(bytes(raw))
    with pytest.raises(BadImage):
        load_image(tmp_path / "bad.png", 3)


def test_decompression_bomb_rejected_without_decoding(tmp_path):
    side = int(MAX_PIXELS ** 0.5) + 10
    p = _save(tmp_path, "bomb.png", Image.new("1", (side, side)))
    assert p.stat().st_size < 200_000  # tiny file, huge image
    with pytest.raises(BadImage, match="decompression bomb"):
        load_image(p, 3)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_108_megapixel_jpeg_decodes_reduced(tmp_path):
    p = tmp_path / "huge.jpg"
    # Made in another process, so that building it does not count in this process's peak memory.
    subprocess.run([sys.executable, "-c", "import sys; from PIL import Image, ImageDraw; im = Image.new('L', (120, 90));"
                    "ImageDraw.Draw(im).ellipse((20, 10, 100, 80), fill=200);"
                    "im.resize((12000, 9000)).save(sys.argv[1], quality=5)", str(p)], check=True)
    assert p.stat().st_size < 3_000_000
    with pytest.raises(BadImage, match="above the --max-pixels limit of 64,000,000"):
        load_image(p, 3)  # no target size known: the limit applies
    before = _peak_rss_mb()
    t = load_image(p, 3, min_side=224)  # 1/8 DCT scaling: 1500x1125 is still >= 224
    assert t.shape == (3, 1125, 1500) and t.dtype == torch.uint8
    assert _peak_rss_mb() - before < 200  # a full decode would need 324 MB for the RGB pixels alone
    assert 150 < float(t[0, 560, 750]) < 250 and float(t[0, 5, 5]) < 50  # the picture, not noise
    assert load_image(p, 1, min_side=1200).shape == (1, 2250, 3000)  # 1/4: the smallest scale >= 1200


def test_extreme_aspect_ratio_refused_before_any_resize(tmp_path):
    p = _save(tmp_path, "strip.png", Image.new("L", (2_000_000, 4), 128))
    assert p.stat().st_size < 100_000
    before = _peak_rss_mb()
    with pytest.raises(BadImage, match=r"2000000x4 pixels \(aspect ratio 1:500000\): resizing it to 224 px"):
        load_image(p, 3, min_side=224)
    assert _peak_rss_mb() - before < 200
    with pytest.raises(BadImage, match="crop it into tiles first"):
        plan_decode("PNG", 2_000_000, 4, 28)
    assert plan_decode("PNG", 1000, 100, 224) == 1  # a 10:1 panorama is fine


def test_max_pixels_zero_means_no_limit():
    assert plan_decode("PNG", 20_000, 20_000, None, max_pixels=0) == 1
    with pytest.raises(BadImage, match="--max-pixels"):
        plan_decode("PNG", 20_000, 20_000, None)


def test_16bit_extremes_round_correctly(tmp_path):
    arr = np.array([[0, 257, 65535, 32767]], dtype=np.uint16)
    t = load_image(_save(tmp_path, "e.png", Image.fromarray(arr)), 1)
    assert t[0, 0].tolist() == [0, 1, 255, 127]


def test_turbo_and_pillow_decode_the_same_pixels(tmp_path):
    p = _save(tmp_path, "n.jpg", Image.effect_noise((64, 48), 40).convert("RGB"), quality=90)
    fast = load_image(p, 3)  # libjpeg-turbo (torchvision)
    with Image.open(p) as im:
        slow = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
    assert fast.shape == slow.shape == (3, 48, 64)
    assert (fast.int() - slow.int()).abs().max() <= 2


def test_only_allowed_formats_are_opened(tmp_path, monkeypatch):
    """Common raster formats decode; an EPS file is refused unopened, so Ghostscript never runs on it."""
    from torchcls.data.images import ALLOWED_FORMATS, read_header

    im = Image.new("RGB", (8, 6), (10, 200, 30))
    for fmt, suffix in (("PNG", "png"), ("JPEG", "jpg"), ("GIF", "gif"), ("BMP", "bmp"), ("TIFF", "tif"),
                        ("WEBP", "webp"), ("PPM", "ppm"), ("ICO", "ico")):
        assert fmt in ALLOWED_FORMATS
        assert load_image(_save(tmp_path, f"a.{suffix}", im, format=fmt), 3).shape == (3, 6, 8), fmt
    # A `gs` on PATH that leaves a mark if anything starts it.
    marker, bin_dir = tmp_path / "gs-ran", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (bin_dir / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{sys.exec_prefix}/bin:/usr/bin:/bin")
    eps = _save(tmp_path, "a.png", im, format="EPS")  # an EPS named like a PNG
    for read in (lambda p: load_image(p, 3), read_header):
        with pytest.raises(BadImage, match="not an image .*accepted: JPEG, PNG"):
            read(eps)
    assert not marker.exists()

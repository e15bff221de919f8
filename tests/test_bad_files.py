"""--on-bad-file error names every unreadable file found before training in one refusal.

The files below fail at different stages (the folder listing, the header scan, the size limits, a
separate validation folder, the in-memory decode); a refusal at the first stage used to name only
that stage's files and leave the others for later runs.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from conftest import make_image_folder, tiny_config
from torchcls.data.refusals import BadFilesError
from torchcls.training import train


def _png_header(w: int, h: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def _bad_files(folder: Path) -> dict[str, str]:
    """One unreadable file of each kind in `folder`; name -> the stage that finds it."""
    good = next(folder.glob("*.png")).read_bytes()
    jpeg = io.BytesIO()
    Image.new("RGB", (48, 48), (9, 9, 9)).save(jpeg, "JPEG")
    (folder / "empty.png").write_bytes(b"")
    (folder / "text.png").write_text("not an image")
    (folder / "cut-header.jpg").write_bytes(jpeg.getvalue()[:40])
    os.symlink(folder / "nowhere.png", folder / "broken.png")
    (folder / "bomb.png").write_bytes(_png_header(60_000, 60_000))
    (folder / "cut-pixels.png").write_bytes(good[: len(good) * 2 // 3])
    return {"empty.png": "header", "text.png": "header", "cut-header.jpg": "header", "broken.png": "listing",
            "bomb.png": "size", "cut-pixels.png": "decode"}


@pytest.fixture
def bad_tree(tmp_path: Path) -> tuple[Path, Path, set[str]]:
    train_dir = make_image_folder(tmp_path / "train", per_class=6)
    val_dir = make_image_folder(tmp_path / "val", per_class=3)
    names = set(_bad_files(train_dir / "circle"))
    (val_dir / "square" / "val-empty.png").write_bytes(b"")
    return train_dir, val_dir, names | {"val-empty.png"}


def _refused(cfg) -> set[str]:
    with pytest.raises(BadFilesError) as e:
        train(cfg)
    assert "--on-bad-file skip" in str(e.value)
    return {Path(file).name for _, bad in e.value.found for file, _ in bad}


def test_every_bad_file_is_named_in_one_refusal(bad_tree, tmp_path: Path) -> None:
    train_dir, val_dir, names = bad_tree
    cfg = tiny_config(train_dir, tmp_path / "runs", epochs=1)
    cfg.data.val_data = str(val_dir)
    assert _refused(cfg) == names  # 7 files; before: the 4 of the first stage
    assert not (tmp_path / "runs" / "run").exists()


def test_streamed_from_files_the_up_front_stages_still_refuse_together(bad_tree, tmp_path: Path) -> None:
    """Not cached in memory, a file whose pixels are cut past a valid header is met only when it is read."""
    train_dir, val_dir, names = bad_tree
    cfg = tiny_config(train_dir, tmp_path / "runs", epochs=1)
    cfg.data.val_data, cfg.data.in_memory = str(val_dir), "off"
    assert _refused(cfg) == names - {"cut-pixels.png"}


def test_skip_trains_without_them_and_lists_each(bad_tree, tmp_path: Path) -> None:
    train_dir, val_dir, names = bad_tree
    cfg = tiny_config(train_dir, tmp_path / "runs", epochs=1)
    cfg.data.val_data, cfg.data.on_bad_file = str(val_dir), "skip"
    result = train(cfg)
    listed = json.loads((result.run_dir / "skipped_files.json").read_text())["skipped_files"]
    assert {Path(s["file"]).name for s in listed} == names

"""Shared fixtures: small real image trees, and one tiny trained run reused by many tests."""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

# Keep Inductor's cache and temp files inside one folder that the session removes.
_SCRATCH = Path(tempfile.mkdtemp(prefix="torchcls-tests-"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_SCRATCH / "inductor"))
# What `torchcls export` records as published on this machine (a .pt2 it made loads with no flag): per session.
os.environ["TORCHCLS_EXPORT_RECORD"] = str(_SCRATCH / "exports.jsonl")
# The timed choice of a training step's layout and precision (training/step_choice.py): cached per session.
os.environ["TORCHCLS_CACHE_DIR"] = str(_SCRATCH / "cache")

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SCRATCH, ignore_errors=True)


def draw_shape(kind: str, size: int, seed: int) -> Image.Image:
    """A real RGB picture of a circle or a square at a random place and colour."""
    rng = np.random.default_rng(seed)
    im = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(0, 80, 3)))
    d = ImageDraw.Draw(im)
    r = int(rng.integers(size // 5, size // 3))
    cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
    color = tuple(int(v) for v in rng.integers(150, 256, 3))
    box = (cx - r, cy - r, cx + r, cy + r)
    (d.ellipse if kind == "circle" else d.rectangle)(box, fill=color)
    return im


def make_image_folder(root: Path, per_class: int = 16, size: int = 32, classes=("circle", "square")) -> Path:
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            # crc32, not hash(): str hashes change with every process (PYTHONHASHSEED), the images must not
            draw_shape(c, size, seed=zlib.crc32(f"{c}{i}".encode()) % 10_000).save(root / c / f"{c}_{i:03d}.png")
    return root


@pytest.fixture
def shapes_dir(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "shapes")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A SmallNet trained briefly on the shapes images (3 channels, 32 px): a real run dir. Trained with
    tiny_config's fixed choices (fp32, NCHW, 2 threads), not the timed and load-dependent ones of the
    defaults: tests hold its weights to accuracy and agreement bounds (top-1, bf16 and int8 parity on 20
    held-out images), which must not move with how busy the machine was when it trained. A run with the
    defaults: tests/test_hardware.py's `auto_run`."""
    from torchcls.training import train

    base = tmp_path_factory.mktemp("trained")
    cfg = tiny_config(make_image_folder(base / "shapes", per_class=40), base / "runs", "shapes", epochs=8)
    cfg.data.batch_size, cfg.data.val_fraction = 16, 0.25
    return train(cfg).run_dir


@pytest.fixture(scope="session")
def aoti_export(trained_run, tmp_path_factory):
    """The trained run exported once per session as an AOTInductor package (max batch 8)."""
    from torchcls.artifacts import export

    return export(trained_run, target="aoti", max_batch=8, out=tmp_path_factory.mktemp("aoti") / "shapes.pt2",
                  precision="fp32")  # tests check it against eager fp32 to 1e-4; auto may pick bf16


@pytest.fixture(scope="session")
def onnx_path(trained_run, tmp_path_factory) -> Path:
    """The trained run exported once per session as ONNX (max batch 8) through the CLI, to cover the command
    as users type it; tests/test_export.py checks it and tests/test_serve_artifacts.py serves it."""
    from torchcls.cli import main

    out = tmp_path_factory.mktemp("onnx") / "shapes.onnx"
    assert main(["export", str(trained_run), "--target", "onnx", "--max-batch", "8", "--out", str(out)]) == 0
    return out


def tiny_config(data: Path, out: Path, name: str = "run", epochs: int = 2):
    from torchcls.config import Config

    cfg = Config()
    cfg.data.source, cfg.data.workers, cfg.data.batch_size, cfg.data.img_size = str(data), 0, 8, 32
    cfg.train.epochs, cfg.train.progress = epochs, False
    # fp32 and NCHW, not the timed choice of --precision auto and an unset --channels-last: tests compare runs
    # of different shapes (ranks, micro-batches) to 1e-4, and must behave alike on every CPU kind.
    # auto: tests/test_hardware.py and tests/test_step_choice.py.
    cfg.precision.precision, cfg.train.channels_last = "fp32", False
    # A fixed thread count, not the default that leaves out CPUs busy at the start: two runs compared bit for
    # bit (tests/test_device_decode.py) must not differ because the machine was busier for one of them.
    cfg.train.threads = 2
    cfg.run.out_dir, cfg.run.name = str(out), name
    return cfg

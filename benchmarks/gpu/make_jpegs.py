"""An ImageFolder of generated photos-like JPEGs for the data-path measurement: N files of about 500x375
(sides drawn from 440-560 x 330-420, as ImageNet's typical photo), quality 90, in --classes folders.
Each picture is smooth colour gradients, a few filled shapes and sensor-like noise, so that it compresses
and decodes like a photograph (entropy per pixel in the range of real photos), not like flat colour.
Deterministic (seeded per file); made by a pool of processes.

    python benchmarks/gpu/make_jpegs.py OUT --images 20000 --classes 100
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(440, 561)), int(rng.integers(330, 421))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([rng.uniform(0, 255) + rng.uniform(-0.4, 0.4) * xx + rng.uniform(-0.4, 0.4) * yy
                     + rng.uniform(10, 40) * np.sin(xx / rng.uniform(8, 40) + rng.uniform(0, 6)) for _ in range(3)], -1)
    im = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(6, 16))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        box = (x0, y0, x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2)))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)(box, fill=colour)
    arr = np.asarray(im).astype(np.int16) + rng.normal(0, 14, (h, w, 3)).astype(np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _write(job: tuple[str, int, int]) -> int:
    out, i, classes = job
    path = Path(out) / f"c{i % classes:04d}" / f"{i:06d}.jpg"
    if not path.exists():
        picture(i).save(path, quality=90)
    return path.stat().st_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--processes", type=int, default=os.cpu_count())
    args = p.parse_args()
    t = time.perf_counter()
    out = Path(args.out)
    for c in range(args.classes):
        (out / f"c{c:04d}").mkdir(parents=True, exist_ok=True)
    with Pool(args.processes) as pool:
        sizes = pool.map(_write, [(str(out), i, args.classes) for i in range(args.images)], chunksize=64)
    summary = {"images": args.images, "classes": args.classes, "mean_bytes": round(sum(sizes) / len(sizes)),
               "seconds": round(time.perf_counter() - t, 1), "processes": args.processes}
    (out.parent / f"{out.name}.json").write_text(json.dumps(summary))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

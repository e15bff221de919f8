"""The data pipeline against timm's, in one run: scan, time to first step, loader and training images/s.

Sections (each runs `--rounds` interleaved rounds, A B A B ...; the figure is the median):
- scan: `torchcls.data.sources.open_source` on a folder of generated 500x375 JPEGs (ms per file);
- first step: seconds from calling `torchcls.train` (ResNet-18 at 64 px, batch 32) on that folder to
  its first optimizer step, measured by a step callback (the run is then interrupted), for each
  `--in-memory` mode;
- loaders: images/s over `--loader-batches` batches from a fresh iterator (worker start-up included),
  same batch size, workers and image size on both sides:
  JPEG folder at 224 px: torchcls's map-style loader vs timm's `create_loader` on a timm
  `ImageDataset` of the same folder (random resized crop + flip on both, no colour jitter), and
  torchcls's in-memory loader on the folder decoded once at 224 px (its build time is reported);
  Fashion-MNIST 60k at 28 px: torchcls's in-memory loader (each preset) and its map-style loader vs
  timm's `create_loader` over a Dataset that serves the same uint8 tensors as PIL images (what
  torchvision's FashionMNIST gives a timm user);
- training: `torchcls.train` vs timm's data pipeline + a plain loop with the same recipe (timm ResNet-18,
  1 channel, 32 px, AdamW 3e-3 wd 0.05 without norms/biases, warm-up + cosine, clip 1.0, label
  smoothing 0.1, random resized crop 0.35-1 + flip) on a folder of Fashion-MNIST PNGs; epoch images/s
  (median over epochs) and top-1 on the official 10k test set; and SmallNet on mnist-5k per --in-memory mode.
  These measure whatever `torchcls.train` does (its metrics.jsonl img_per_s), whichever loader it uses.

Generated data lives in --cache-dir and is made once. Never asserts; prints JSON, then Markdown.
Needs a quiet machine (load average is recorded before and after).

    python benchmarks/data_pipeline.py --out data_pipeline.json
    python benchmarks/data_pipeline.py --quick          # small counts: a smoke test, not figures
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from torchcls.config import Config, DataConfig
from torchcls.data import build_data, make_loader
from torchcls.data.inmemory import InMemoryLoader, build_cache
from torchcls.data.sources import STATS, open_source
from torchcls.machine import describe_machine, machine_line

FMNIST_STATS = STATS["fashion-mnist"]
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


# ---------------------------------------------------------------- generated data (made once)

def jpeg_folder(cache: Path, count: int) -> Path:
    """`count` 500x375 JPEGs (shapes on gradients with noise: real entropy, ~photo-sized files) in 10 classes."""
    root = cache / f"jpeg-{count}"
    if (root / ".complete").is_file():
        return root

    def make(i: int) -> None:
        rng = np.random.default_rng(i)
        base = np.linspace(rng.integers(0, 128, 3), rng.integers(128, 256, 3), 500, dtype=np.float32)
        pixels = np.broadcast_to(base, (375, 500, 3)) + rng.normal(0, 12, (375, 500, 3))
        im = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(im)
        for _ in range(6):
            x, y, r = int(rng.integers(0, 500)), int(rng.integers(0, 375)), int(rng.integers(10, 90))
            draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        folder = root / f"c{i % 10}"
        im.save(folder / f"img{i:06d}.jpg", quality=90)

    for c in range(10):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(make, range(count)))
    (root / ".complete").write_text(str(count))
    return root


def fmnist_folder(cache: Path, count: int, split: str = "train") -> Path:
    """The first `count` Fashion-MNIST images of `split` (train, test) as an ImageFolder of grey PNGs (readable
    by timm too)."""
    root = cache / (f"fmnist-png-{count}" if split == "train" else f"fmnist-{split}-png-{count}")
    if (root / ".complete").is_file():
        return root
    images = open_source("fashion-mnist", None, split, None, "error")
    for c in range(10):
        (root / str(c)).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.fromarray(images.images[i].numpy(), "L").save(root / str(int(images.targets[i])) / f"{i:05d}.png")
    (root / ".complete").write_text(str(count))
    return root


class TensorPIL(torch.utils.data.Dataset):
    """uint8 (N, H, W) tensors served as PIL images through `.transform`, which timm's create_loader sets."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor):
        self.images, self.targets, self.transform = images.numpy(), targets.tolist(), None

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        img = Image.fromarray(self.images[i], "L")
        return (self.transform(img) if self.transform else img), self.targets[i]


# ---------------------------------------------------------------- measurements

def rate(loader, batches: int) -> float:
    """Images/s over `batches` batches of a fresh iterator (start-up included, as each epoch pays it)."""
    t0, seen = time.perf_counter(), 0
    for k, (x, _) in enumerate(loader):
        seen += len(x)
        if k + 1 == batches:
            break
    return seen / (time.perf_counter() - t0)


def timm_loader(dataset, channels: int, size: int, args, stats, batch: int):
    from timm.data import create_loader

    return create_loader(dataset, input_size=(channels, size, size), batch_size=batch, is_training=True,
                         scale=(0.35, 1.0), color_jitter=None, mean=stats[0], std=stats[1],
                         num_workers=args.workers, device=torch.device("cpu"))


def scan_ms_per_file(folder: Path, count: int) -> float:
    t0 = time.perf_counter()
    open_source(str(folder), None, "train", None, "error")
    return (time.perf_counter() - t0) * 1000 / count


def base_config(args, out: Path, name: str) -> Config:
    cfg = Config()
    cfg.data.workers, cfg.train.threads, cfg.train.progress = args.workers, args.threads, False
    cfg.precision.precision = "fp32"  # as the timm loop it is compared with (the default, auto, may pick bf16)
    cfg.run.out_dir, cfg.run.name = str(out), name
    return cfg


def first_step_seconds(args, folder: Path, out: Path, mode: str, i: int) -> float:
    from torchcls.training import train

    cfg = base_config(args, out, f"first-{mode}-{i}")
    cfg.data.source, cfg.data.img_size, cfg.data.batch_size, cfg.data.augment = str(folder), 64, 32, "standard"
    cfg.data.in_memory = mode  # a field of DataConfig; ignored by a trainer that predates it
    cfg.model.name, cfg.train.epochs = "resnet18", 1
    t0, first = time.perf_counter(), []

    def stop(step: int) -> None:
        first.append(time.perf_counter() - t0)
        raise KeyboardInterrupt  # the trainer's documented interrupt: checkpoint and return

    train(cfg, callbacks=[stop])
    return first[0]


def fmnist_loaders(args) -> dict[str, object]:
    """The Fashion-MNIST loaders compared in the same rounds (built once; iterated fresh each round)."""
    cfg = DataConfig()
    cfg.source, cfg.val_fraction, cfg.workers, cfg.augment = "fashion-mnist", 0.0, args.workers, "standard"
    bundle = build_data(cfg, 0)
    images, pre = bundle.images, bundle.preprocess
    cache, _ = build_cache(images, pre)
    loaders: dict[str, object] = {
        f"torchcls in-memory ({aug})": InMemoryLoader(cache, images.targets, pre, args.batch_size, train=True,
                                                      augment=aug, seed=i)
        for i, aug in enumerate(("standard", "flip", "light"))}
    loaders["torchcls map-style (standard)"] = make_loader(bundle.train, args.batch_size, args.workers, shuffle=True)
    loaders["timm create_loader (rrc+flip)"] = timm_loader(TensorPIL(images.images, images.targets), 1, 28, args,
                                                           FMNIST_STATS, args.batch_size)
    return loaders


def jpeg_loaders(args, folder: Path) -> tuple[dict[str, object], float]:
    """The JPEG-folder loaders, and the seconds it took to decode the folder into the in-memory cache."""
    from timm.data import ImageDataset

    cfg = DataConfig()
    cfg.source, cfg.val_fraction, cfg.workers, cfg.augment, cfg.img_size = str(folder), 0.0, args.workers, \
        "standard", 224
    bundle = build_data(cfg, 0)
    t0 = time.perf_counter()
    cache, _ = build_cache(bundle.images, bundle.preprocess)  # crops then come from the 224 px cache
    cache_s = time.perf_counter() - t0
    return {"torchcls map-style (standard)": make_loader(bundle.train, args.jpeg_batch, args.workers, shuffle=True),
            "torchcls in-memory (standard)": InMemoryLoader(cache, bundle.images.targets, bundle.preprocess,
                                                            args.jpeg_batch, train=True, augment="standard"),
            "timm create_loader (rrc+flip)": timm_loader(ImageDataset(str(folder)), 3, 224, args, IMAGENET,
                                                         args.jpeg_batch)}, cache_s


# ---------------------------------------------------------------- training

def test_top1(model: torch.nn.Module, size: int, mean: float, std: float) -> float:
    """Top-1 on the official Fashion-MNIST test set, resized as torchcls's eval transform does and
    normalised with the statistics the model was trained with (each side's own)."""
    from torchvision.transforms.v2 import functional as TF

    test = open_source("fashion-mnist", None, "test", 1, "error")
    x = TF.resize(test.images.unsqueeze(1), size, antialias=True).float().div(255)
    x = (x - mean) / std
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(b).argmax(1) for b in x.split(500)])
    return (pred == test.targets).float().mean().item()


def torchcls_training(args, folder: Path, out: Path, i: int) -> dict[str, float]:
    from torchcls.checkpoint.files import load_model
    from torchcls.training import train

    cfg = base_config(args, out, f"train-{i}")
    cfg.data.source, cfg.data.channels, cfg.data.img_size, cfg.data.augment = str(folder), 1, 32, "standard"
    cfg.data.val_fraction, cfg.data.batch_size = 0.0, args.batch_size
    cfg.model.name, cfg.train.epochs = "resnet18", args.train_epochs
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    epochs = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["img_per_s"] for r in epochs if r.get("kind") == "epoch"]
    model, meta = load_model(result.last_checkpoint)
    top1 = test_top1(model, 32, meta.preprocess.mean[0], meta.preprocess.std[0])  # a folder: ImageNet grey stats
    return {"img_per_s": statistics.median(rates), "wall_s": wall, "test_top1": top1}


def timm_training(args, folder: Path, i: int) -> dict[str, float]:
    """timm's dataset + create_loader and a hand-written loop with torchcls's default recipe."""
    import timm
    from timm.data import ImageDataset

    torch.manual_seed(i)
    t0 = time.perf_counter()
    loader = timm_loader(ImageDataset(str(folder), input_img_mode="L"), 1, 32, args, FMNIST_STATS, args.batch_size)
    model = timm.create_model("resnet18", num_classes=10, in_chans=1)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3)
    steps, warmup = len(loader) * args.train_epochs, max(1, len(loader) // 2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, steps - warmup))))))
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    rates = []
    model.train()
    for _ in range(args.train_epochs):
        t_epoch, seen = time.perf_counter(), 0
        for x, y in loader:
            loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            seen += len(y)
        rates.append(seen / (time.perf_counter() - t_epoch))
    wall = time.perf_counter() - t0
    return {"img_per_s": statistics.median(rates), "wall_s": wall,
            "test_top1": test_top1(model, 32, FMNIST_STATS[0][0], FMNIST_STATS[1][0])}


def smallnet_img_per_s(args, out: Path, mode: str, i: int) -> float:
    from torchcls.training import train

    cfg = base_config(args, out, f"smallnet-{mode}-{i}")
    cfg.data.source, cfg.data.in_memory, cfg.data.batch_size = "mnist-5k", mode, args.batch_size
    cfg.train.epochs = args.smallnet_epochs
    result = train(cfg)
    epochs = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["img_per_s"] for r in epochs if r.get("kind") == "epoch")


# ---------------------------------------------------------------- the run

def median_of(values: list[float], digits: int = 1) -> dict[str, object]:
    return {"median": round(statistics.median(values), digits), "rounds": [round(v, digits) for v in values]}


def measure(args, out: Path) -> dict[str, object]:
    cache = Path(args.cache_dir).expanduser()
    jpegs, pngs = jpeg_folder(cache, args.jpegs), fmnist_folder(cache, args.fmnist_images)
    modes = ("off", "auto")
    scan = [scan_ms_per_file(jpegs, args.jpegs) for _ in range(args.rounds)]
    first: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.rounds):
        for m in modes:
            first[m].append(first_step_seconds(args, jpegs, out, m, i))
    jpeg, cache_s = jpeg_loaders(args, jpegs)
    loaders = {"jpeg": jpeg, "fashion-mnist": fmnist_loaders(args)}
    rates: dict[str, dict[str, list[float]]] = {k: {name: [] for name in v} for k, v in loaders.items()}
    for _ in range(args.rounds):  # interleaved: every loader once per round
        for kind, named in loaders.items():
            for name, ld in named.items():
                rates[kind][name].append(rate(ld, args.jpeg_batches if kind == "jpeg" else args.loader_batches))
    training: dict[str, list[dict[str, float]]] = {"torchcls train": [], "timm loader + plain loop": []}
    for i in range(args.train_rounds):
        training["torchcls train"].append(torchcls_training(args, pngs, out, i))
        training["timm loader + plain loop"].append(timm_training(args, pngs, i))
    smallnet: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.rounds):
        for m in modes:
            smallnet[m].append(smallnet_img_per_s(args, out, m, i))
    return {
        "scan_ms_per_file": median_of(scan, 3),
        "first_step_s": {f"in_memory={m}": median_of(v, 2) for m, v in first.items()},
        "jpeg_cache_build_s": round(cache_s, 1),
        "loader_img_per_s": {k: {n: median_of(v, 0) for n, v in named.items()} for k, named in rates.items()},
        "training": {name: {key: median_of([r[key] for r in runs], 4 if key == "test_top1" else 1)
                            for key in ("img_per_s", "wall_s", "test_top1")} for name, runs in training.items()},
        "smallnet_mnist5k_img_per_s": {f"in_memory={m}": median_of(v, 0) for m, v in smallnet.items()},
    }


def markdown(r: dict) -> str:
    lines = [f"Machine: {machine_line(r['machine'])}", "",
             f"Scan: {r['scan_ms_per_file']['median']} ms per file ({r['setup']['jpegs']} JPEGs, 500x375).", "",
             "| time to first step (ResNet-18, 64 px, batch 32) | seconds |", "|---|---|"]
    lines += [f"| {k} | {v['median']} |" for k, v in r["first_step_s"].items()]
    for kind, named in r["loader_img_per_s"].items():
        timm_rate = next(v["median"] for n, v in named.items() if n.startswith("timm"))
        lines += ["", f"| loader, {kind} | images/s | vs timm |", "|---|---|---|"]
        lines += [f"| {n} | {v['median']:.0f} | {v['median'] / timm_rate:.2f}x |" for n, v in named.items()]
    lines += ["", f"Decoding the JPEG folder into the in-memory cache (224 px) took {r['jpeg_cache_build_s']} s."]
    lines += ["", f"| training (ResNet-18, 32 px, {r['setup']['fmnist_images']} Fashion-MNIST PNGs, "
              f"{r['setup']['train_epochs']} epochs) | images/s | wall s | test top-1 |", "|---|---|---|---|"]
    lines += [f"| {n} | {v['img_per_s']['median']:.0f} | {v['wall_s']['median']} | {v['test_top1']['median']:.2%} |"
              for n, v in r["training"].items()]
    lines += ["", "| SmallNet on mnist-5k | images/s |", "|---|---|"]
    lines += [f"| {k} | {v['median']:.0f} |" for k, v in r["smallnet_mnist5k_img_per_s"].items()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small counts: checks that the benchmark runs")
    p.add_argument("--out", help="also write the JSON here (and the Markdown next to it, .md)")
    p.add_argument("--cache-dir", default="~/.cache/torchcls/bench-data", help="where generated data is kept")
    p.add_argument("--jpegs", type=int, default=10_000, help="JPEGs in the generated folder")
    p.add_argument("--fmnist-images", type=int, default=10_000, help="Fashion-MNIST PNGs for the training part")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-rounds", type=int, default=2)
    p.add_argument("--train-epochs", type=int, default=3)
    p.add_argument("--smallnet-epochs", type=int, default=3)
    p.add_argument("--loader-batches", type=int, default=200, help="Fashion-MNIST batches per loader measurement")
    p.add_argument("--jpeg-batches", type=int, default=50, help="JPEG batches per loader measurement")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--jpeg-batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.quick:
        args.jpegs, args.fmnist_images, args.rounds, args.train_rounds = 200, 1000, 1, 1
        args.train_epochs, args.smallnet_epochs, args.loader_batches, args.jpeg_batches = 1, 1, 10, 3
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="torchcls-bench-data-") as tmp:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp) / "inductor"))
        result = {"benchmark": "data_pipeline", "quick": args.quick, "setup": vars(args), **measure(args, Path(tmp))}
    result["machine"] = describe_machine("fp32")
    result["load_average_1min"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    text = json.dumps(result, indent=2)
    print(text)
    print()
    print(markdown(result))
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".md").write_text(markdown(result) + "\n")


if __name__ == "__main__":
    sys.exit(main())

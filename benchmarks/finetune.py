"""Accuracy vs number of labelled images: SmallNet from scratch vs fine-tuned from Fashion-MNIST.

First trains one SmallNet on Fashion-MNIST (the source task), then, for each size N (default 50 /
200 / 1000 labelled digits of mnist-5k, N/10 per class, drawn per seed from the training pool),
trains SmallNet on those N images twice: from random weights and with `--pretrained` the Fashion-MNIST
run (its classifier re-initialised for the digits). Every run gets the same number of optimizer steps
(--steps) and is scored on the same 1,000 held-out mnist-5k digits (100 per class, never trained
on): the top-1 of the last epoch, no selection on that set. The subsets are written once as PNG
files with a CSV manifest (path,label,split), so each run is a plain `torchcls train --data CSV`.
Prints JSON, a Markdown table, and writes a plot (benchmarks/results/finetune.png).

One more row: a real ImageNet-pretrained backbone (--imagenet-model, a timm name with a pretrained
tag) fine-tuned on the largest size (`--pretrained` alone: the tag's weights from the Hugging Face
hub), when its weights are in the local hub cache; otherwise the row says "skipped: not in cache"
(nothing is downloaded: a benchmark does not wait on the network).

    python benchmarks/finetune.py                  # 50/200/1000 images, 3 seeds
    python benchmarks/finetune.py --quick          # tiny end-to-end check (minutes), plot in a temp dir
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from torchcls.config import Config
from torchcls.data.sources import open_source
from torchcls.machine import describe_machine, machine_line
from torchcls.training import train
from torchcls.training.rundir import read_metrics

RESULTS = Path(__file__).resolve().parent / "results"
VAL_PER_CLASS = 100


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="50,200,1000", help="labelled training images per run (multiples of 10)")
    p.add_argument("--seeds", default="0,1,2", help="seeds: each draws its own subsets and initialisation")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every digit run")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--pretrain-epochs", type=int, default=2, help="epochs of the Fashion-MNIST run")
    p.add_argument("--pretrain-images", type=int, default=0, help="Fashion-MNIST training images (0 = all 60,000)")
    p.add_argument("--plot", default=str(RESULTS / "finetune.png"))
    p.add_argument("--imagenet-model", default="resnet18.a1_in1k", help="timm name with an ImageNet pretrained tag "
                   "for the extra row (its weights must be in the local hub cache; 'none' leaves the row out)")
    p.add_argument("--imagenet-img-size", type=int, default=64, help="input size of the ImageNet row (--img-size "
                   "overrides the backbone's 224 px: the digits are 28 px, and 224 px costs 12x the compute)")
    p.add_argument("--quick", action="store_true", help="a tiny end-to-end check: sizes 50,200, one seed, 20 steps, "
                   "one epoch on 2,000 Fashion-MNIST images, plot in a temporary folder")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.seeds, args.steps, args.pretrain_epochs, args.pretrain_images = "50,200", "0", 20, 1, 2000
    return args


def base_config(data: str, out: Path, name: str, seed: int, batch_size: int, lr: float) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.channels, cfg.data.img_size, cfg.data.workers = data, 1, 28, 0
    cfg.data.batch_size, cfg.optim.lr, cfg.train.seed = batch_size, lr, seed
    cfg.model.name, cfg.train.progress = "smallnet", False
    cfg.run.out_dir, cfg.run.name = str(out), name
    return cfg


def write_manifest(path: Path, images, labels, rows: list[tuple[int, str]], class_names: list[str]) -> Path:
    """PNG files for `rows` [(index, split)] and a CSV manifest path,label,split beside them."""
    folder = path.parent / "images"
    folder.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "split"])
        for i, split in rows:
            png = folder / f"{path.parent.name}-{i}.png"
            if not png.exists():
                Image.fromarray(images[i]).save(png)
            w.writerow([png.relative_to(path.parent), class_names[labels[i]], split])
    return path


def per_class(labels: np.ndarray, pool: np.ndarray, n_per_class: int, rng: np.random.Generator) -> np.ndarray:
    """n_per_class indices of each class from `pool`, in a seeded random order."""
    return np.concatenate([rng.permutation(pool[labels[pool] == c])[:n_per_class] for c in range(10)])


def pretrain(work: Path, args) -> Path:
    """The source-task run: SmallNet on Fashion-MNIST (all of it, or a class-balanced subset)."""
    data = "fashion-mnist"
    if args.pretrain_images:
        fashion = open_source("fashion-mnist", None, "train", 1, "error")
        images, labels = fashion.images.numpy(), fashion.targets.numpy()
        rng = np.random.default_rng(0)
        chosen = per_class(labels, np.arange(len(labels)), args.pretrain_images // 10, rng)
        rows = [(int(i), "val" if k % 10 == 0 else "train") for k, i in enumerate(rng.permutation(chosen))]
        data = str(write_manifest(work / "fashion" / "fashion.csv", images, labels, rows, fashion.classes))
    cfg = base_config(data, work / "runs", "fashion", 0, 128, args.lr)
    cfg.train.epochs = args.pretrain_epochs
    if not args.pretrain_images:
        cfg.data.val_fraction = 0.1
    result = train(cfg)
    print(json.dumps({"pretrain": data, "val_top1": result.val_top1}), file=sys.stderr, flush=True)
    return result.run_dir


def digit_run(csv_path: Path, n: int, seed: int, pretrained: Path | str | None, work: Path, args,
              imagenet: bool = False) -> float:
    """Train on the N labelled digits of `csv_path`; the last epoch's top-1 on the fixed held-out digits.
    `imagenet`: --imagenet-model from its hub weights, the digits shown as RGB at --imagenet-img-size."""
    name = f"{'imagenet' if imagenet else 'finetuned' if pretrained else 'scratch'}-{n}-seed{seed}"
    cfg = base_config(str(csv_path), work / "runs", name, seed, min(args.batch_size, n), args.lr)
    steps_per_epoch = math.ceil(n / cfg.data.batch_size)  # the last, smaller batch is kept (no drop_last)
    cfg.train.epochs = max(1, math.ceil(args.steps / steps_per_epoch))
    cfg.model.pretrained = str(pretrained) if pretrained else None
    if imagenet:  # mean/std, interpolation and crop follow the backbone's pretrained config
        cfg.model.name, cfg.data.channels, cfg.data.img_size = args.imagenet_model, 3, args.imagenet_img_size
    run_dir = train(cfg).run_dir
    last = [r for r in read_metrics(run_dir) if r.get("kind") == "epoch"][-1]
    return float(last["val_top1"])


def run(args, work: Path) -> list[dict]:
    digits = open_source("mnist-5k", None, "train", 1, "error")
    images, labels = digits.images.numpy(), digits.targets.numpy()
    everything = np.arange(len(labels))
    val = per_class(labels, everything, VAL_PER_CLASS, np.random.default_rng(1234))  # the same for every run
    pool = np.setdiff1d(everything, val)
    fashion_run = pretrain(work, args)
    results, largest = [], {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        order = np.random.default_rng(seed)
        for n in sorted(int(s) for s in args.sizes.split(",")):
            train_idx = per_class(labels, pool, n // 10, order)
            rows = [(int(i), "train") for i in train_idx] + [(int(i), "val") for i in val]
            csv_path = write_manifest(work / f"digits-{n}-seed{seed}" / "digits.csv", images, labels, rows,
                                      digits.classes)
            for mode, pretrained in (("scratch", None), ("finetuned", fashion_run)):
                top1 = digit_run(csv_path, n, seed, pretrained, work, args)
                results.append({"images": n, "seed": seed, "mode": mode, "val_top1": round(top1, 4)})
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # progress while it runs
            largest[seed] = (n, csv_path)
    if imagenet_skipped(args.imagenet_model) is None:
        for seed, (n, csv_path) in largest.items():
            top1 = digit_run(csv_path, n, seed, "hub", work, args, imagenet=True)
            results.append({"images": n, "seed": seed, "mode": "imagenet", "model": args.imagenet_model,
                            "img_size": args.imagenet_img_size, "val_top1": round(top1, 4)})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def imagenet_skipped(model: str) -> str | None:
    """Why the ImageNet row is not run (None: it is): its weights must already be in the local hub cache."""
    from timm.models import get_pretrained_cfg

    from torchcls.models.hub import cache_dir, in_cache

    if model == "none":
        return "skipped: --imagenet-model none"
    cfg = get_pretrained_cfg(model)
    if cfg is None or not cfg.hf_hub_id:
        return f"skipped: {model} has no pretrained weights on the Hugging Face hub"
    if not in_cache(cfg.hf_hub_id):
        return (f"skipped: not in cache ({cache_dir()} has no hf-hub:{cfg.hf_hub_id}; `torchcls train --model "
                f"{model} --pretrained` where the network is reachable fills it)")
    return None


def imagenet_line(results: list[dict], args) -> str:
    """The ImageNet row of the Markdown table, or why it was skipped."""
    runs = [r["val_top1"] for r in results if r["mode"] == "imagenet"]
    if not runs:
        return f"| ImageNet-pretrained {args.imagenet_model} | {imagenet_skipped(args.imagenet_model)} | | |"
    n = results[-1]["images"]
    scratch = statistics.fmean(r["val_top1"] for r in results if r["mode"] == "scratch" and r["images"] == n)
    mean = statistics.fmean(runs)
    return (f"| {n}, ImageNet-pretrained {args.imagenet_model} at {args.imagenet_img_size} px | {scratch:.2%} | "
            f"{mean:.2%} | {mean - scratch:+.2%} |")


def summary(results: list[dict]) -> list[dict]:
    rows = []
    for n in sorted({r["images"] for r in results}):
        row = {"images": n}
        for mode in ("scratch", "finetuned"):
            vals = [r["val_top1"] for r in results if r["images"] == n and r["mode"] == mode]
            row[mode] = {"mean": round(statistics.fmean(vals), 4), "min": min(vals), "max": max(vals), "runs": len(vals)}
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs = [r["images"] for r in rows]
    for mode, label in (("scratch", "from scratch"), ("finetuned", "fine-tuned from Fashion-MNIST")):
        mean = [r[mode]["mean"] for r in rows]
        err = [[m - r[mode]["min"] for m, r in zip(mean, rows)], [r[mode]["max"] - m for m, r in zip(mean, rows)]]
        ax.errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log")
    ax.minorticks_off()  # only the sizes that were run are labelled
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("labelled mnist-5k training images")
    ax.set_ylabel("top-1 on 1,000 held-out digits")
    ax.set_title("SmallNet: scratch vs fine-tuned (min-max over seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ran_in_auto() -> str:
    import torch

    from torchcls.precision.hardware import choose_precision

    return choose_precision("auto", torch.device("cpu")).precision


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = run(args, work)
        rows = summary(results)
    # --quick keeps its plot out of benchmarks/results/ (it is a check, not a result)
    plot_path = Path(tempfile.gettempdir()) / "torchcls-finetune-quick.png" if args.quick else Path(args.plot)
    plot(rows, plot_path)
    settings = {k: getattr(args, k) for k in ("sizes", "seeds", "steps", "batch_size", "lr", "pretrain_epochs",
                                               "pretrain_images", "quick")}
    machine = describe_machine(f"auto -> {ran_in_auto()}")  # every run trains at the default precision
    print(json.dumps({"benchmark": "finetune", "settings": settings, "machine": machine, "runs": results,
                      "summary": rows}, indent=2))
    print(f"\nMachine: {machine_line(machine)}")
    print("\n| labelled images | from scratch | fine-tuned from Fashion-MNIST | gain |\n|---|---|---|---|")
    for r in rows:
        s, f = r["scratch"]["mean"], r["finetuned"]["mean"]
        print(f"| {r['images']} | {s:.2%} | {f:.2%} | {f - s:+.2%} |")
    print(imagenet_line(results, args))
    print(f"\ntop-1 on the same 1,000 held-out digits, mean of {len(args.seeds.split(','))} seed(s); plot: {plot_path}")


if __name__ == "__main__":
    sys.exit(main())

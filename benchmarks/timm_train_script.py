"""`torchcls train` against timm's own `train.py` on one recipe: images/s and test top-1, several seeds.

timm's train.py is its repository's training script; the timm wheel does not ship it, so pass its path
(`--train-py`): `git clone https://github.com/huggingface/pytorch-image-models` (or download the train.py of the
tag that matches `pip show timm`). Both sides train ResNet-18 from scratch on the same Fashion-MNIST PNG folder
(`--images` training images, 1 channel at 32 px) with the recipe of timm_pipeline.RECIPE: random resized crops
(scale 0.35-1, bilinear) and flips, AdamW lr 3e-3 wd 0.05 (norms and biases undecayed on both sides), one
warm-up epoch from 0 then cosine to 0 over the rest (train.py takes whole warm-up epochs; `--warmup-prefix`
gives the schedule torchcls builds), label smoothing 0.1, gradient clipping at 1.0, batch 128, 2 loader workers.

What each side does by itself stays its own: timm decodes the PNGs in its 2 workers every epoch
(`--no-prefetcher`: the CPU path) and runs with torch's default thread count; torchcls trains at its defaults
(its in-memory feed where the images fit, its timed layout and precision, its thread rule). Images/s: per
epoch, timm's own report (the epoch's last log line: batch size over the mean update time) and torchcls's
metrics.jsonl; each run's figure is the median of its epochs after the first. Test top-1 on the official
10,000 test images: timm's own evaluation of its last epoch (summary.csv, the test PNGs, `--crop-pct 1`:
resized to 32 px, no crop) and torchcls's model through data_pipeline.test_top1 (the same pixels, resized the
same way). Precision modes: fp32 on both sides, and `auto`: what torchcls's --precision auto picks, against
train.py with `--amp --amp-dtype bfloat16` where the CPU has native bf16 (what a timm user turns on there), else
fp32. Seeds alternate which side goes first. Prints JSON, then a Markdown table naming the machine.

    python benchmarks/timm_train_script.py --train-py ~/pytorch-image-models/train.py --seeds 0,1,2,3,4
    python benchmarks/timm_train_script.py --train-py train.py --seeds 0 --epochs 2 --images 1000   # smoke
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import timm_pipeline as tp
from data_pipeline import FMNIST_STATS, fmnist_folder  # noqa: I001 (sibling scripts)
from torchcls.machine import describe_machine, machine_line
from torchcls.precision.hardware import cpu_bf16_here

WARMUP_EPOCHS = 1  # train.py's --warmup-epochs is a whole number
# The last line of each epoch: "Train: 2 [  77/78 (100%)] ... (0.181s,  707.12/s) ..." (epoch, mean rate)
EPOCH_RATE = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+) \(100%\)\].*?\(\s*[\d.]+s,\s*([\d.]+)/s\)")


def timm_data(cache: Path, images: int) -> Path:
    """A folder train.py reads by split name: train/ (the PNGs torchcls trains on) and test/ (the official test
    set), as links to the two PNG folders."""
    root = cache / f"timm-fmnist-{images}"
    root.mkdir(parents=True, exist_ok=True)
    for split, folder in (("train", fmnist_folder(cache, images)), ("test", fmnist_folder(cache, 10_000, "test"))):
        link = root / split
        if not link.exists():
            link.symlink_to(folder.resolve(), target_is_directory=True)
    return root


def timm_command(train_py: Path, data: Path, out: Path, epochs: int, seed: int, amp_bf16: bool) -> list[str]:
    r = tp.RECIPE
    cmd = [sys.executable, str(train_py), "--data-dir", str(data), "--train-split", "train", "--val-split", "test",
           "--model", r["model"], "--num-classes", "10", "--in-chans", str(r["channels"]), "--input-img-mode", "L",
           "--img-size", str(r["img_size"]), "--crop-pct", "1.0",
           "--mean", str(FMNIST_STATS[0][0]), "--std", str(FMNIST_STATS[1][0]),
           "--scale", str(r["scale"][0]), str(r["scale"][1]), "--hflip", "0.5", "--color-jitter", "0",
           "--train-interpolation", "bilinear",
           "--opt", "adamw", "--lr", str(r["lr"]), "--weight-decay", str(r["weight_decay"]),
           "--sched", "cosine", "--sched-on-updates", "--epochs", str(epochs - WARMUP_EPOCHS),
           "--warmup-epochs", str(WARMUP_EPOCHS), "--warmup-prefix", "--warmup-lr", "0", "--min-lr", "0",
           "--cooldown-epochs", "0", "--smoothing", str(r["label_smoothing"]), "--clip-grad", str(r["grad_clip"]),
           "-b", str(r["batch_size"]), "-j", str(r["workers"]), "--device", "cpu", "--no-prefetcher",
           "--seed", str(seed), "--checkpoint-hist", "1", "--output", str(out), "--experiment", f"seed{seed}"]
    return cmd + (["--amp", "--amp-dtype", "bfloat16"] if amp_bf16 else [])


def timm_side(train_py: Path, data: Path, out: Path, epochs: int, seed: int, amp_bf16: bool) -> dict:
    cmd = timm_command(train_py, data, out, epochs, seed, amp_bf16)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    log = done.stdout + done.stderr
    if done.returncode:
        raise SystemExit(f"timm's train.py failed (exit {done.returncode}):\n{' '.join(cmd)}\n{log[-3000:]}")
    rates = [float(m.group(4)) for m in EPOCH_RATE.finditer(log)]
    with open(out / f"seed{seed}" / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if len(rates) != epochs or len(rows) != epochs:
        raise SystemExit(f"timm's train.py ran {len(rows)} epoch(s), {len(rates)} epoch rate line(s); expected "
                         f"{epochs} (its log format may have changed):\n{log[-3000:]}")
    return {"img_per_s": statistics.median(rates[1:] or rates), "epochs_img_per_s": rates,
            "test_top1": float(rows[-1]["eval_top1"]) / 100,
            "ran": f"{'bf16 (AMP)' if amp_bf16 else 'fp32'}, NCHW, torch's default threads"}


def run(args) -> dict:
    cache = Path(args.cache_dir).expanduser()
    folder, data = fmnist_folder(cache, args.images), timm_data(cache, args.images)
    native = cpu_bf16_here()[0]
    modes = args.modes.split(",")
    runs: dict[str, dict[str, list[dict]]] = {m: {"torchcls": [], "timm": []} for m in modes}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(args.seeds):
            for mode, sides in runs.items():
                out = Path(tmp) / f"{mode}-{seed}"
                (out / "timm").mkdir(parents=True)
                arms = [lambda: sides["torchcls"].append(tp.torchcls_side(
                            folder, out, "torchcls", args.epochs, mode, seed=seed, warmup_epochs=WARMUP_EPOCHS)),
                        lambda: sides["timm"].append(timm_side(
                            args.train_py, data, out / "timm", args.epochs, seed, mode == "auto" and native))]
                for arm in arms[::-1] if i % 2 else arms:  # each side goes first for every other seed
                    arm()
                print(f"seed {seed} {mode}: " + ", ".join(
                    f"{side} {r[-1]['img_per_s']:.0f} img/s {r[-1]['test_top1']:.2%}" for side, r in sides.items()),
                    file=sys.stderr, flush=True)
    return {"benchmark": "train_vs_timm_train_py", "recipe": tp.RECIPE | {"warmup_epochs": WARMUP_EPOCHS},
            "images": args.images, "epochs": args.epochs, "seeds": args.seeds, "train_py": str(args.train_py),
            "machine": describe_machine(", ".join(modes)), "versions": versions(),
            "load_average": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
            "runs": runs, "summary": summarise(runs)}


def versions() -> dict[str, str]:
    import timm
    import torch

    import torchcls

    return {"torch": torch.__version__, "timm": timm.__version__, "torchcls": torchcls.__version__}


def summarise(runs: dict[str, dict[str, list[dict]]]) -> dict:
    summary = {}
    for mode, sides in runs.items():
        rate = {side: statistics.median(r["img_per_s"] for r in rs) for side, rs in sides.items()}
        top1 = {side: statistics.median(r["test_top1"] for r in rs) for side, rs in sides.items()}
        diffs = [a["test_top1"] - b["test_top1"] for a, b in zip(sides["torchcls"], sides["timm"])]
        summary[mode] = {"median_img_per_s": {k: round(v, 1) for k, v in rate.items()},
                         "ratio": round(rate["torchcls"] / rate["timm"], 3),
                         "median_test_top1": {k: round(v, 4) for k, v in top1.items()},
                         "top1_difference_points": round(100 * (top1["torchcls"] - top1["timm"]), 2),
                         "per_seed_difference_points": [round(100 * d, 2) for d in diffs],
                         "ran": {side: rs[-1]["ran"] for side, rs in sides.items()}}
    return summary


def print_report(result: dict) -> None:
    print(json.dumps(result, indent=2))
    load, v = result["load_average"], result["versions"]
    print(f"\nMachine: {machine_line(result['machine'])}; torch {v['torch']}, timm {v['timm']}; load average "
          f"{load['before']:.2f} before, {load['after']:.2f} after; {len(result['seeds'])} seeds, "
          f"{result['epochs']} epochs of {result['images']:,} images\n\n| precision mode | torchcls ran | timm ran | "
          "torchcls images/s | train.py images/s | ratio | median test top-1 torchcls / timm | difference, "
          "per seed (points) |\n|---|---|---|---|---|---|---|---|")
    for mode, s in result["summary"].items():
        m, t = s["median_img_per_s"], s["median_test_top1"]
        print(f"| {mode} | {s['ran']['torchcls']} | {s['ran']['timm']} | {m['torchcls']:.0f} | {m['timm']:.0f} | "
              f"{s['ratio']:.2f}x | {t['torchcls']:.2%} / {t['timm']:.2%} | {s['top1_difference_points']:+.2f} "
              f"({', '.join(f'{d:+.2f}' for d in s['per_seed_difference_points'])}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-py", type=Path, required=True, help="timm's train.py (from its repository)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3, 4])
    p.add_argument("--epochs", type=int, default=3, help="at least 2 (one warm-up epoch, then cosine)")
    p.add_argument("--images", type=int, default=10_000, help="Fashion-MNIST training images as PNGs")
    p.add_argument("--modes", default="fp32,auto", help="precision modes, of fp32 and auto")
    p.add_argument("--cache-dir", default="~/.cache/torchcls-bench", help="where the PNG folders are kept")
    args = p.parse_args()
    if not args.train_py.is_file():
        raise SystemExit(f"--train-py {args.train_py}: no such file; it is train.py of "
                         "https://github.com/huggingface/pytorch-image-models")
    if args.epochs < 2 or set(args.modes.split(",")) - {"fp32", "auto"}:
        raise SystemExit("--epochs: at least 2; --modes: fp32 and/or auto")
    args.train_py = args.train_py.resolve()
    print_report(run(args))


if __name__ == "__main__":
    main()

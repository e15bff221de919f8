"""Early-exit SmallNet vs the same backbone without exits, on Fashion-MNIST (mnist-5k if absent).

Trains both with the same config and seed (short), then on the test images reports, per exit
threshold: accuracy, exit fractions, mean FLOPs per image (torch.utils.flop_counter) and mean
eager latency per image at batch 1 (interleaved rounds, median). Prints JSON and a Markdown table.

    PYTHONPATH=src python benchmarks/early_exit.py --epochs 2 --out /tmp/ee-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from torchcls.checkpoint.files import load_model
from torchcls.config import Config
from torchcls.data import eval_dataset, make_loader
from torchcls.evaluation.evaluator import predict_logits
from torchcls.evaluation.exit_sweep import all_exit_logits, calibrate, exit_costs, sweep, sweep_point
from torchcls.machine import describe_machine, machine_line
from torchcls.precision.hardware import choose_precision
from torchcls.training import train

FASHION = Path("/usr/share/datasets/fashion-mnist")


def train_both(data: str, epochs: int, out: Path) -> dict[str, Path]:
    runs = {}
    for name in ("smallnet", "ee/smallnet"):
        cfg = Config()
        cfg.data.source, cfg.data.val_fraction, cfg.data.workers = data, 0.1, 1
        cfg.train.epochs, cfg.train.progress, cfg.train.seed = epochs, False, 0
        cfg.model.name = name
        cfg.run.out_dir, cfg.run.name = str(out), name.replace("/", "-")
        t0 = time.perf_counter()
        runs[name] = train(cfg).best_checkpoint
        print(f"trained {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return runs


@torch.no_grad()
def latency_ms(fn, images: torch.Tensor) -> float:
    fn(images[:1])
    t0 = time.perf_counter()
    for i in range(len(images)):
        fn(images[i:i + 1])
    return (time.perf_counter() - t0) * 1000 / len(images)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default="/tmp/torchcls-ee-bench")
    ap.add_argument("--thresholds", default="0.8,0.9,0.95,0.99")
    ap.add_argument("--latency-images", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=None, help="default: fashion-mnist when installed, else mnist-5k")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread gives steadier per-image timings
    data = args.data or ("fashion-mnist" if FASHION.is_dir() else "mnist-5k")
    runs = train_both(data, args.epochs, Path(args.out))
    plain, meta = load_model(runs["smallnet"])
    ee, _ = load_model(runs["ee/smallnet"])
    split = "test" if data == "fashion-mnist" else "val"
    cfg = Config.from_dict(meta.config)
    test, _ = eval_dataset(cfg.data, meta.preprocess, split, 0)
    val, _ = eval_dataset(cfg.data, meta.preprocess, "val", 0)
    loader = make_loader(test, 512, 0, shuffle=False)
    shape = (meta.preprocess.channels, meta.preprocess.img_size, meta.preprocess.img_size)

    plain_logits, targets = predict_logits(plain, loader, torch.device("cpu"))
    plain_acc = float((plain_logits.argmax(1) == targets).float().mean())
    logits, targets = all_exit_logits(ee, loader, torch.device("cpu"))
    costs = exit_costs(ee, shape)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        plain(torch.zeros(1, *shape))
    plain_flops = fc.get_total_flops()

    # Calibrated on the validation split: the cheapest threshold within 0.5 pt of the plain net's val accuracy.
    val_loader = make_loader(val, 512, 0, shuffle=False)
    pv, tv = predict_logits(plain, val_loader, torch.device("cpu"))
    vl, vt = all_exit_logits(ee, val_loader, torch.device("cpu"))
    target = float((pv.argmax(1) == tv).float().mean()) - 0.005
    calibrated = calibrate(sweep(vl, vt, costs), target_accuracy=target).threshold
    thresholds = sorted({float(t) for t in args.thresholds.split(",")} | {calibrated})

    images = torch.stack([test[i][0] for i in range(min(args.latency_images, len(test)))])
    variants = {"plain": plain} | {f"ee@{t:g}": t for t in thresholds}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):  # interleaved: every variant once per round
        for key, v in variants.items():
            if key == "plain":
                times[key].append(latency_ms(plain, images))
            else:
                ee.threshold = v
                times[key].append(latency_ms(ee, images))

    rows = [{"model": "smallnet (no exits)", "threshold": None, "accuracy": plain_acc, "mflops": plain_flops / 1e6,
             "relative_compute": 1.0, "exit_fractions": None, "latency_ms": statistics.median(times["plain"])}]
    for t in thresholds:
        p = sweep_point(logits, targets, costs, t)
        ee.threshold = t
        eager_logits, _ = predict_logits(ee, loader, torch.device("cpu"))  # the real dynamic forward
        rows.append({"model": "ee/smallnet", "threshold": t, "calibrated": t == calibrated,
                     "accuracy": float((eager_logits.argmax(1) == targets).float().mean()),
                     "simulated_accuracy": p.accuracy, "mflops": p.mean_flops / 1e6,
                     "relative_compute": p.mean_flops / plain_flops, "exit_fractions": p.exit_fractions,
                     "latency_ms": statistics.median(times[f"ee@{t:g}"])})
    result = {"data": data, "split": split, "n": len(targets), "epochs": args.epochs, "threads": 1,
              "latency_images": len(images), "rounds": args.rounds, "ee_final_exit_accuracy":
              sweep_point(logits, targets, costs, 2.0).accuracy, "calibration_target_val_accuracy": target,
              "rows": rows}
    trained_in = choose_precision(Config().precision.precision, torch.device("cpu")).precision
    result["machine"] = describe_machine(f"training auto -> {trained_in}, inference fp32")
    print(json.dumps(result, indent=2))
    print(f"\nMachine: {machine_line(result['machine'])}")
    print("\n| model | threshold | accuracy | Δ pt vs plain | MFLOP/img | compute vs plain | exits (%) | ms/img b1 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fr = " / ".join(f"{f:.0%}" for f in r["exit_fractions"]) if r["exit_fractions"] else "-"
        th = "-" if r["threshold"] is None else f"{r['threshold']:g}" + (" (cal.)" if r.get("calibrated") else "")
        print(f"| {r['model']} | {th} | {r['accuracy']:.2%} | {100 * (r['accuracy'] - plain_acc):+.2f} | "
              f"{r['mflops']:.2f} | {r['relative_compute']:.0%} | {fr} | {r['latency_ms']:.2f} |")


if __name__ == "__main__":
    main()

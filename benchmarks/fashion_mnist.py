"""Time to ≥94% top-1 on the official Fashion-MNIST test set, on this machine's CPU.

Trains with `torchcls.training` on all 60,000 training images (the recipe below), then
evaluates on the 10,000 test images with `torchcls.evaluation`. The baseline in the same
run is the time and accuracy at the end of each epoch (the test set is evaluated after
every epoch by a step callback, outside the timed training work). Prints JSON, then a
Markdown table.

    python benchmarks/fashion_mnist.py                # the recipe
    python benchmarks/fashion_mnist.py --epochs 3     # a shorter schedule
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchcls.checkpoint.files import load_model
from torchcls.config import Config
from torchcls.data import eval_dataset, make_loader
from torchcls.evaluation.evaluator import predict_logits
from torchcls.training import train

TARGET = 0.94


def recipe(args: argparse.Namespace, out: Path) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.val_fraction = "fashion-mnist", 0.0  # train on all 60k; test = official 10k
    cfg.data.batch_size, cfg.data.workers, cfg.data.augment = args.batch_size, args.workers, args.augment
    cfg.model.name = args.model
    cfg.optim.lr, cfg.optim.label_smoothing = args.lr, 0.1
    cfg.train.epochs, cfg.train.channels_last, cfg.train.threads = args.epochs, True, args.threads
    cfg.train.progress = False
    cfg.run.out_dir, cfg.run.name = str(out), "fashion"
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smallnet")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--augment", default="flip")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe(args, Path(tmp))
        run_dir = Path(tmp) / "fashion"
        per_epoch: list[dict] = []
        t_start = time.perf_counter()
        excluded = 0.0  # time spent evaluating the test set between epochs, not part of training
        steps_per_epoch = -(-60000 // args.batch_size)

        def test_after_epoch(step: int) -> None:
            nonlocal excluded
            if step % steps_per_epoch:
                return
            t0 = time.perf_counter()
            trained = t0 - t_start - excluded
            model, meta = load_model(run_dir / "checkpoints" / "last.safetensors")
            ds, _ = eval_dataset(cfg.data, meta.preprocess, "test", cfg.train.seed)
            logits, targets = predict_logits(model, make_loader(ds, 500, args.workers, shuffle=False),
                                             torch.device("cpu"))
            excluded += time.perf_counter() - t0
            per_epoch.append({"epoch": step // steps_per_epoch, "train_s": round(trained, 1),
                              "test_top1": round((logits.argmax(1) == targets).float().mean().item(), 4)})

        cfg.checkpoint.save_every = steps_per_epoch  # last.safetensors is current when the callback runs
        train(cfg, callbacks=[test_after_epoch])
        total = time.perf_counter() - t_start - excluded
    reached = next((e for e in per_epoch if e["test_top1"] >= TARGET), None)
    result = {"benchmark": "fashion_mnist", "target_top1": TARGET, "recipe": vars(args),
              "train_seconds": round(total, 1), "final_test_top1": per_epoch[-1]["test_top1"],
              "seconds_to_target": reached["train_s"] if reached else None, "per_epoch": per_epoch}
    print(json.dumps(result, indent=2))
    print("\n| epoch | training seconds | test top-1 |\n|---|---|---|")
    for e in per_epoch:
        print(f"| {e['epoch']} | {e['train_s']} | {e['test_top1']:.2%} |")
    verdict = f"reached {TARGET:.0%} after {reached['train_s']} s" if reached else f"did not reach {TARGET:.0%}"
    print(f"\n{verdict} ({args.model}, {args.epochs} epochs, batch {args.batch_size}, 2 threads)")


if __name__ == "__main__":
    sys.exit(main())

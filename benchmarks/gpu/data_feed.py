"""Images/s of one training setup fed three ways: synthetic batches already on the device, torchcls's feed
decoding JPEGs on the GPU (--decode device), and torchcls's feed decoding them in DataLoader workers
(--decode workers). One process, one compiled model (compiled once: the arms differ only in their feed),
torchcls's precision plan and train step; each arm times `--steps` steps after `--warmup`, with one CUDA
event pair around them and no host synchronisation of its own (what the feed itself waits for counts).

    python benchmarks/gpu/data_feed.py --data JPEG_FOLDER --json data_feed.json            # on a GPU
    python benchmarks/gpu/data_feed.py --data DIR --json t.json --device cpu --model resnet18 --img-size 64 \
        --batch 8 --steps 2 --warmup 1 --workers 2                                          # the CPU stand-in

The feeds are the ones `torchcls train` builds (training/feed.py build_feed, from a Config with the same
options); the full `torchcls train` runs with each --decode are part 2 of the device check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def config(args, decode: str):
    from torchcls.config import Config

    cfg = Config()
    d = cfg.data
    d.source, d.img_size, d.augment, d.batch_size, d.workers = args.data, args.img_size, "standard", args.batch, \
        args.workers
    d.in_memory, d.decode, d.val_fraction = "off", decode, 0.02
    cfg.train.device, cfg.train.channels_last, cfg.precision.precision = args.device, True, "bf16"
    return cfg


def timed(step, batches, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """images/s over `steps` steps, each taking its batch from `batches` (an iterator) and stepping."""
    seen = 0
    for _ in range(warmup):
        step(*next(batches))
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        step(x, y)
        seen += len(y)
    if device.type == "cuda":
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
    else:
        ms = (time.perf_counter() - t) * 1e3
    return {"images_per_s": round(seen / ms * 1e3, 1), "steps": steps, "images": seen}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--arms", default="synthetic,device,workers")
    args = p.parse_args()

    from torchcls.data import build_data
    from torchcls.models import ModelSpec, create_model
    from torchcls.precision.training import apply_precision
    from torchcls.training.distributed import Session
    from torchcls.training.feed import build_feed

    device, out, rec = torch.device(args.device), Path(args.json), {}
    cfg = config(args, "workers")
    data = build_data(cfg.data, cfg.train.seed)
    rec.update(model=args.model, batch=args.batch, img_size=args.img_size, workers=args.workers, device=str(device),
               train_images=len(data.train), classes=len(data.classes), precision="bf16", compiled=True)
    torch.manual_seed(0)
    model = create_model(ModelSpec(args.model, len(data.classes), 3, args.img_size)).to(device,
                                                                                     memory_format=torch.channels_last)
    plan = apply_precision(model, cfg.precision, device, compile=True)
    forward = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    plan.defer_checks(opt)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.to(device, memory_format=torch.channels_last, non_blocking=True), y.to(device, non_blocking=True)
        with plan.autocast():
            loss = loss_fn(forward(x), y)
        opt.zero_grad(set_to_none=True)
        plan.backward_step(loss, opt, model, 1.0, 1)

    g = torch.Generator(device=device).manual_seed(0)
    synthetic = [(torch.randn(args.batch, 3, args.img_size, args.img_size, device=device, generator=g),
                  torch.randint(0, len(data.classes), (args.batch,), device=device, generator=g)) for _ in range(2)]
    t = time.perf_counter()
    step(*synthetic[0])
    rec["first_step_s"] = round(time.perf_counter() - t, 1)  # the compile, shared by every arm
    for arm in args.arms.split(","):
        log(arm)
        if arm == "synthetic":
            batches = (synthetic[i % 2] for i in range(10**9))
        else:
            feed = build_feed(config(args, arm), data, Session(), device)
            batches = iter(_cycle(feed))
        rec[arm] = timed(step, batches, device, args.warmup, args.steps)
        out.write_text(json.dumps(rec, indent=2))
    plan.check()
    for arm in ("device", "workers"):
        if arm in rec and "synthetic" in rec:
            rec[f"{arm}_fraction_of_synthetic"] = round(rec[arm]["images_per_s"] / rec["synthetic"]["images_per_s"], 3)
    out.write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec))
    return 0


def _cycle(feed):
    epoch = 0
    while True:
        yield from feed.epoch(epoch, 0)
        epoch += 1


if __name__ == "__main__":
    sys.exit(main())

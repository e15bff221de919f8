"""torchcls train against timm's own training pipeline, one recipe, in one run (train_throughput.py --vs-timm).

The timm side is what timm's train.py does on a CPU, reduced to its parts: `ImageDataset` over the
folder, `create_loader` (its RandomResizedCrop + flip transforms in DataLoader workers), `create_model`,
`create_optimizer_v2`, `create_scheduler_v2` (cosine with warm-up), label-smoothing cross-entropy,
`dispatch_clip_grad`, and AMP through `torch.autocast` where the run uses bf16 (train.py --amp
--amp-dtype bfloat16). The recipe is torchcls's default for this data, mirrored on both sides:
ResNet-18, 1 channel at 32 px, random resized crops (scale 0.35-1) + flips, AdamW lr 3e-3 wd 0.05,
warm-up 0.5 epoch + cosine, label smoothing 0.1, gradient clipping at 1.0, batch 128, 2 workers.
Each side's images/s is the median of its epochs after the first; top-1 is on the official
Fashion-MNIST test set, through each side's own normalisation.

What differs is each side's own: torchcls feeds the images from its in-memory uint8 cache when they fit
(its default; the augmentation then runs batched in the training process, no workers), timm decodes the
PNGs in its 2 workers every epoch; torchcls times its layout and chooses its threads (machine.py),
timm runs with the thread count torch started with in this process, as train.py does. Both are recorded.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from data_pipeline import FMNIST_STATS, fmnist_folder, test_top1  # noqa: I001 (a sibling script)

START_THREADS = torch.get_num_threads()  # what timm's train.py runs with: torch's default for this process
RECIPE = {"model": "resnet18", "img_size": 32, "channels": 1, "batch_size": 128, "lr": 3e-3, "weight_decay": 0.05,
          "warmup_epochs": 0.5, "label_smoothing": 0.1, "grad_clip": 1.0, "scale": (0.35, 1.0), "workers": 2}


def folder(cache: Path, images: int) -> Path:
    return fmnist_folder(cache, images)


def torchcls_side(data: Path, out: Path, name: str, epochs: int, precision: str, seed: int = 0,
                  warmup_epochs: float = RECIPE["warmup_epochs"]) -> dict:
    """`torchcls train` with the recipe and everything else at its defaults (layout and auto precision timed).
    `warmup_epochs`: timm's train.py takes whole epochs only (timm_train_script.py sets 1 on both sides)."""
    from torchcls.checkpoint.files import load_model
    from torchcls.config import Config
    from torchcls.training import train

    cfg = Config()
    cfg.data.source, cfg.data.channels, cfg.data.img_size = str(data), RECIPE["channels"], RECIPE["img_size"]
    cfg.data.augment, cfg.data.val_fraction, cfg.data.batch_size = "standard", 0.0, RECIPE["batch_size"]
    cfg.data.workers = RECIPE["workers"]
    cfg.model.name, cfg.train.epochs, cfg.train.progress = RECIPE["model"], epochs, False
    cfg.precision.precision, cfg.train.seed = precision, seed  # each round its seed, as timm's side
    cfg.optim.warmup_epochs = warmup_epochs
    cfg.run.out_dir, cfg.run.name = str(out), name
    result = train(cfg)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["img_per_s"] for r in records if r.get("kind") == "epoch"]
    model, meta = load_model(result.last_checkpoint)
    step = json.loads((result.run_dir / "step_choice.json").read_text())
    machine = json.loads((result.run_dir / "machine.json").read_text())
    return {"img_per_s": statistics.median(rates[1:] or rates), "epochs_img_per_s": [round(r, 1) for r in rates],
            "test_top1": test_top1(model, RECIPE["img_size"], meta.preprocess.mean[0], meta.preprocess.std[0]),
            "ran": f"{step['precision']['precision']}, {'channels-last' if step['channels_last'] else 'NCHW'}, "
                   f"{machine['torch_threads']} threads"}


def timm_side(data: Path, epochs: int, amp_bf16: bool, seed: int) -> dict:
    import timm
    from timm.data import ImageDataset, create_loader
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import dispatch_clip_grad

    torch.manual_seed(seed)
    torch.set_num_threads(START_THREADS)  # not what the torchcls run before it chose
    size = RECIPE["img_size"]
    loader = create_loader(ImageDataset(str(data), input_img_mode="L"), input_size=(1, size, size),
                           batch_size=RECIPE["batch_size"], is_training=True, use_prefetcher=False,
                           scale=RECIPE["scale"], color_jitter=None, mean=FMNIST_STATS[0], std=FMNIST_STATS[1],
                           num_workers=RECIPE["workers"], persistent_workers=True)
    model = timm.create_model(RECIPE["model"], num_classes=10, in_chans=1).train()
    optimizer = create_optimizer_v2(model, "adamw", lr=RECIPE["lr"], weight_decay=RECIPE["weight_decay"])
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=epochs, warmup_epochs=RECIPE["warmup_epochs"],
                                       step_on_epochs=False, updates_per_epoch=len(loader),
                                       warmup_lr=RECIPE["lr"] / 100)
    criterion = LabelSmoothingCrossEntropy(RECIPE["label_smoothing"])
    rates, updates = [], 0
    for epoch in range(epochs):
        t0, seen = time.perf_counter(), 0
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp_bf16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            dispatch_clip_grad(model.parameters(), RECIPE["grad_clip"])
            optimizer.step()
            updates += 1
            scheduler.step_update(num_updates=updates)
            seen += len(y)
        rates.append(seen / (time.perf_counter() - t0))
    return {"img_per_s": statistics.median(rates[1:] or rates), "epochs_img_per_s": [round(r, 1) for r in rates],
            "test_top1": test_top1(model, size, FMNIST_STATS[0][0], FMNIST_STATS[1][0]),
            "ran": f"{'bf16 (AMP)' if amp_bf16 else 'fp32'}, NCHW, {START_THREADS} threads"}

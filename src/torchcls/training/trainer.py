"""The run of a training job: a `Trainer` steps the model one batch at a time (`train_step`),
through an epoch (`run_epoch`, then `validate`), checkpoints it (`end_epoch`) and finishes the run.
`torchcls.training.build` makes one from a config; each step fits on a screen.

Reproducibility: the data order, every sample's augmentation and the main-process RNG are functions
of (seed, epoch, position), and a mid-epoch checkpoint stores the step within the epoch plus the RNG
state; resuming starts the feed at that step (training/feed.py), so a resumed run ends with the same
weights as an uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.checkpoint.checkpointer import Checkpointer, Progress
from torchcls.checkpoint.files import CheckpointMeta
from torchcls.config import Config
from torchcls.console import console
from torchcls.models import ModelSpec
from torchcls.models.early_exit import exit_loss
from torchcls.precision.training import PrecisionPlan
from torchcls.training.distributed import Session
from torchcls.training.feed import Feed
from torchcls.training.resume_options import apply_optim_changes
from torchcls.training.resume_options import record as resume_record
from torchcls.training.rundir import RunDir
from torchcls.training.tensorboard import write_scalars
from torchcls.training.validation import validate

StepCallback = Callable[[int], None]  # called with the global step after each optimizer step


@dataclass
class TrainResult:
    run_dir: Path
    best_checkpoint: Path
    last_checkpoint: Path
    val_top1: float | None
    steps: int
    interrupted: bool = False


# -- the run ----------------------------------------------------------------------------------
@dataclass
class Trainer:
    cfg: Config
    session: Session
    run: RunDir
    gov: Any
    device: torch.device
    memory_format: torch.memory_format
    data: Any  # torchcls.data.DataBundle
    spec: ModelSpec
    model: nn.Module  # what is saved
    forward: nn.Module  # what runs: the model, or its compiled forward
    precision: PrecisionPlan
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    criterion: nn.Module
    feed: Feed
    checkpointer: Checkpointer
    callbacks: list[StepCallback]
    mixing: Any = None  # --mixup/--cutmix (torchcls.data.mixing), keyed by the global step: resumes exactly
    memory: Any = None  # the --memory-report recorder
    writer: Any = None  # TensorBoard
    progress: Progress = field(default_factory=Progress)
    resume_rng: torch.Tensor | None = None  # restored once a resumed epoch is replayed to its step
    resume_changes: dict[str, Any] = field(default_factory=dict)  # options changed by --resume (resume_options)

    def __post_init__(self) -> None:
        self.model.train()

    def meta(self) -> CheckpointMeta:
        pre, p = self.data.preprocess, self.progress
        return CheckpointMeta(self.spec, self.data.classes, pre, self.cfg.to_dict(), p.epoch, p.step)

    def save(self) -> None:
        self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.progress, self.meta(), self.precision)
        p = self.progress
        self.feed.save_state(self.run.checkpoints, self.session.rank, p.step, p.step_in_epoch)

    def resume(self) -> None:
        self.progress, self.resume_rng = self.checkpointer.resume(self.model, self.optimizer, self.scheduler,
                                                                  self.meta(), self.precision)
        p = self.progress
        self.feed.load_state(self.run.checkpoints, self.session.rank, p.step)
        self.run.truncate_metrics(p.step)
        if self.resume_changes:
            apply_optim_changes(self.optimizer, self.scheduler, self.resume_changes)
            self.log(resume_record(self.resume_changes, p.step))
            console.print("changed on resume: " + ", ".join(f"{k} {b!r} -> {n!r}"
                                                           for k, (b, n) in self.resume_changes.items()))
        world = f" (world size {self.session.world})" if self.session.active else ""
        console.print(f"resuming {self.run.path} at epoch {p.epoch + 1}, step {p.step}{world}")

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step on a batch already on the device. Returns the loss, the (final exit's)
        logits and whether the step was applied (False: a NaN/Inf step skipped under --nonfinite skip)."""
        targets = y
        if self.mixing is not None:  # soft targets; training accuracy stays against the hard labels
            x, targets = self.mixing(x, y, step=self.progress.step)
        with self.precision.autocast():
            logits = self.forward(x)
        loss, logits = exit_loss(self.criterion, logits, targets, self.model)  # early-exit models: all exits
        self.optimizer.zero_grad(set_to_none=True)
        stepped = self.precision.backward_step(loss, self.optimizer, self.model, self.cfg.optim.grad_clip,
                                               self.progress.step + 1)
        self.scheduler.step()
        self.progress.step += 1
        self.progress.step_in_epoch += 1
        return loss, logits, stepped

    def _batches(self):
        """This epoch's batches from the checkpointed position on (see training/feed.py for how each feed gets there)."""
        batches = self.feed.epoch(self.progress.epoch, self.progress.step_in_epoch)
        if self.resume_rng is not None:
            torch.set_rng_state(self.resume_rng)
            self.resume_rng = None
        return batches

    def run_epoch(self, bar) -> dict[str, Any]:
        """Train one epoch (or its rest); returns the epoch record, validation included."""
        cfg, p, steps = self.cfg, self.progress, len(self.feed)
        task = bar.add_task(f"epoch {p.epoch + 1}/{cfg.train.epochs}", total=steps, completed=p.step_in_epoch)
        log_every, save_every = cfg.train.log_every or max(1, steps // 10), cfg.checkpoint.save_every
        # Sums stay on the device: read once at the end of the epoch, not synchronised every step.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        t0, seen = time.perf_counter(), 0
        for x, y in self._batches():
            # Every image of this batch failed to decode (--on-bad-file skip). Known limit: under torchrun
            # only this rank skips the step, and the others wait for it in the gradient all-reduce.
            if not len(y):
                continue
            x, y = x.to(self.device, memory_format=self.memory_format, non_blocking=True), y.to(self.device)
            loss, logits, stepped = self.train_step(x, y)
            if stepped:  # a skipped NaN/Inf step is logged by the plan, not averaged in
                seen += len(y)
                loss_sum += loss.detach().double() * len(y)
                correct += (logits.argmax(1) == y).sum()
            bar.update(task, advance=1)
            if p.step % log_every == 0:
                self.log({"kind": "step", "epoch": p.epoch + 1, "step": p.step, "loss": self.session.mean(loss),
                          "lr": self.scheduler.get_last_lr()[0]})
            if save_every and p.step % save_every == 0:
                self.save()
            for cb in (*self.callbacks, *self.session.callbacks()):
                cb(p.step)
        elapsed = time.perf_counter() - t0
        record = {"kind": "epoch", "epoch": p.epoch + 1, "step": p.step,
                  "train_loss": loss_sum.item() / max(1, seen), "train_top1": correct.item() / max(1, seen),
                  "img_per_s": seen / max(elapsed, 1e-9), "epoch_s": elapsed}
        record = self.session.reduce_epoch(record)
        if self.feed.val is not None:
            own = self.feed.val_own(self.session.rank, self.session.world)
            record |= validate(self.forward, self.feed.val, own, self.device, self.precision, self.memory_format,
                               self.session)
        return record

    def end_epoch(self, record: dict[str, Any]) -> None:
        """Log the epoch, checkpoint it, and keep the best weights."""
        p = self.progress
        p.epoch, p.step_in_epoch = p.epoch + 1, 0
        self.log(record)
        _print_epoch(record, self.cfg.train.epochs)
        self.save()
        top1 = record.get("val_top1", record["train_top1"])
        if top1 > p.best_top1:
            p.best_top1 = top1
            self.checkpointer.save_best(self.model, self.meta())

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(record)
        write_scalars(self.writer, record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.checkpointer.wait()  # background (async) saves
        self.session.close()

    def finish(self) -> TrainResult:
        """After the last epoch: memory report, run report, governance record."""
        if self.memory:
            self.memory.finish()
        from torchcls.report import write_report

        if self.session.is_main:
            self._write_skipped()
            write_report(self.run.path)
        self.gov.finish(self.result())  # redacted sample outputs, audit record
        return self.result()

    def _write_skipped(self) -> None:
        """skipped_files.json: files left out at the scan, the in-memory cache or decode time, by any rank."""
        if self.feed.kind == "shards":
            n = self.data.write_skipped_files(self.run.path, self.feed.decode_skips())
        else:
            self.data.images.skipped.extend(f for f in self.feed.skipped_at_cache if f not in self.data.images.skipped)
            n = self.data.write_skipped_files(self.run.path)
        if n:
            console.print(f"[yellow]{n} file(s) left out of training; listed in skipped_files.json and the report[/]")

    def result(self, interrupted: bool = False) -> TrainResult:
        p, ckpt = self.progress, self.checkpointer
        best = ckpt.best_weights
        return TrainResult(self.run.path, best if best.exists() else ckpt.last_weights, ckpt.last_weights,
                           p.best_top1 if p.best_top1 >= 0 else None, p.step, interrupted)


def _print_epoch(r: dict[str, Any], epochs: int) -> None:
    val = f"  val loss {r['val_loss']:.4f}  val top1 {r['val_top1']:.2%}" if "val_top1" in r else ""
    console.print(f"epoch {r['epoch']}/{epochs}  train loss {r['train_loss']:.4f}  "
                  f"train top1 {r['train_top1']:.2%}{val}  {r['img_per_s']:.0f} img/s")

"""The run of a training job: a `Trainer` steps the model one batch at a time (`train_step`),
through an epoch (`run_epoch`, then `validate`), checkpoints it (`end_epoch`) and finishes the run.
`torchcls.training.build` makes one from a config; each step fits on a screen.

Reproducibility: the data order, every sample's augmentation and the main-process RNG are functions
of (seed, epoch, position), and a mid-epoch checkpoint stores the step within the epoch plus the RNG
state; resuming starts the feed at that step (training/feed.py), so a resumed run ends with the same
weights as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.checkpoint.checkpointer import Checkpointer, Progress
from torchcls.checkpoint.files import CheckpointMeta, read_meta
from torchcls.config import Config
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.events import CheckpointSaved, RunFinished, RunGuard, publish
from torchcls.models import ModelSpec
from torchcls.models.early_exit import exit_loss
from torchcls.precision.training import PrecisionPlan
from torchcls.tasks import best_score, train_correct
from torchcls.training.distributed import Session
from torchcls.training.feed import Feed
from torchcls.training.parallel import grad_sync
from torchcls.training.resize import parse_schedule, resize_batch, size_at
from torchcls.training.resume_options import apply_optim_changes
from torchcls.training.resume_options import record as resume_record
from torchcls.training.rundir import RunDir, read_metrics
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
    written: tuple[Path, ...] = ()  # the checkpoint files this run wrote (not those a resumed run dir held)


# -- the run ----------------------------------------------------------------------------------
@dataclass
class Trainer:
    cfg: Config
    session: Session
    run: RunDir
    gov: RunGuard  # what governs the run (torchcls.events.RunStarted), or Unguarded
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
    ema: Any = None  # --ema: torchcls.training.ema.WeightEma, updated after each optimizer step
    selective: Any = None  # --selective-backprop: torchcls.training.selective.SelectiveBackprop
    micro: int = 0  # micro-batches of the current --accum-steps window done so far
    window: int = 1  # micro-batches in the current window
    thresholds: list[float] | None = None  # multilabel: per-label thresholds chosen on the validation set
    tracker: Any = None  # --tracking mlflow (training/tracking.py), rank 0 only
    # Called with the 0-based epoch and the global step before the epoch's first batch, a resumed epoch's too
    # (--freeze-first-bias-after-epochs, the thread tuner). Given values, not the trainer: a hook that held it
    # would make a reference cycle, and the run's loader workers would live on until a garbage collection.
    at_epoch_start: list[Callable[[int, int], None]] = field(default_factory=list)
    # The epoch's running sums on the device (loss x images, correct, images), and (perf_counter at the
    # epoch's (re)start, seconds it ran before): see epoch_sums(), which checkpoints save.
    sums: torch.Tensor | None = None
    clock: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        self.model.train()

    def meta(self, thresholds: list[float] | None = None) -> CheckpointMeta:
        pre, p = self.data.preprocess, self.progress
        return CheckpointMeta(self.spec, self.data.classes, pre, self.cfg.to_dict(), p.epoch, p.step,
                              thresholds or self.thresholds)

    def save(self) -> None:
        p = self.progress
        p = dataclasses.replace(p, epoch_sums=self.epoch_sums())
        if self.micro:  # interrupted inside an accumulation window: a resume replays its micro-batches (the
            # sums hold only applied steps' batches, as the position saved here does)
            p = dataclasses.replace(p, step_in_epoch=p.step_in_epoch - self.micro)
        self.checkpointer.save(self.model, self.optimizer, self.scheduler, p, self.meta(), self.precision)
        self.feed.save_state(self.run.checkpoints, self.session.rank, p.step, p.step_in_epoch)
        publish(CheckpointSaved(self.run.path, self.checkpointer.last_weights, p.step))

    def resume(self) -> None:
        built_weight_decays = [g.get("weight_decay", 0.0) for g in self.optimizer.param_groups]  # the new options'
        self.progress, self.resume_rng = self.checkpointer.resume(self.model, self.optimizer, self.scheduler,
                                                                  self.meta(), self.precision)
        p = self.progress
        if p.step_in_epoch > len(self.feed):  # (both formats range it; only the feed knows the epoch's length)
            raise UserError(f"{self.run.checkpoints}: the training state is at step {p.step_in_epoch} of an epoch, "
                            f"but this run's epochs have {len(self.feed)} steps: it is from other data or another "
                            "--batch-size or process count, or damaged. Resume with the run's own data and options, "
                            "or start over")
        if self.checkpointer.last_weights.is_file():  # multilabel: the thresholds saved with the resumed weights
            self.thresholds = read_meta(self.checkpointer.last_weights).thresholds
        self.feed.load_state(self.run.checkpoints, self.session.rank, p.step)
        self.run.truncate_metrics(p.step)
        if self.resume_changes:
            apply_optim_changes(self.optimizer, self.scheduler, self.resume_changes,
                                schedule_restored=not self.checkpointer.resumes_from_dcp(),
                                built_weight_decays=built_weight_decays)
            self.log(resume_record(self.resume_changes, p.step))
            console.print("changed on resume: " + ", ".join(f"{k} {b!r} -> {n!r}"
                                                           for k, (b, n) in self.resume_changes.items()))
        world = f" (world size {self.session.world})" if self.session.active else ""
        console.print(f"resuming {self.run.path} at epoch {p.epoch + 1}, step {p.step}{world}")

    def train_step(self, x: torch.Tensor,
                   y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool | torch.Tensor | None]:
        """Forward and backward of one micro-batch already on the device; after every --accum-steps of them
        (fewer at the end of an epoch), the optimizer step. Returns the loss, the (final exit's) logits and
        the step: None while gradients accumulate, else whether it was applied (False: a NaN/Inf step
        skipped under --nonfinite skip; a device bool tensor when the check is deferred, see PrecisionPlan)."""
        p, accum = self.progress, self.cfg.optim.accum_steps
        if self.micro == 0:  # a new accumulation window: as many micro-batches as are left, up to accum
            self.window = max(1, min(accum, len(self.feed) - p.step_in_epoch))
            self.optimizer.zero_grad(set_to_none=True)  # here, not after the step: gradients are part of
            # the training state between steps, as the memory report (memory.json) counts them
        last = self.micro + 1 == self.window
        targets = y
        if self.mixing is not None:  # soft targets; training accuracy stays against the hard labels
            x, targets = self.mixing(x, y, step=p.step * accum + self.micro)
        scored = None
        if self.selective is not None and self.selective.applies(p.epoch):  # --selective-backprop
            with torch.no_grad(), self.precision.autocast():
                scored = self.forward(x)
            keep = self.selective.hardest(scored, y)
            x, targets = x[keep], targets[keep]
        with grad_sync(self.model, last):  # inner micro-batches add up gradients locally (DDP/FSDP2)
            with self.precision.autocast():
                logits = self.forward(x)
            loss, logits = exit_loss(self.criterion, logits, targets, self.model)  # early-exit models: all exits
            self.precision.backward(loss, scale=1.0 / self.window)
        if scored is not None:  # training accuracy stays over the whole batch (the loss is the trained images')
            logits = scored
        p.step_in_epoch += 1
        self.micro = 0 if last else self.micro + 1
        return loss, logits, self.optimizer_step() if last else None

    def optimizer_step(self) -> bool | torch.Tensor:
        p = self.progress
        stepped = self.precision.step(self.optimizer, self.model, self.cfg.optim.grad_clip, p.step + 1)
        self.scheduler.step()
        p.step += 1
        if self.ema is not None and stepped is not False:  # (deferred: a skipped step left the weights as they were)
            self.ema.update(self.model, p.step)
        return stepped

    def _batches(self):
        """This epoch's batches from the checkpointed position on (see training/feed.py for how each feed gets there)."""
        batches = self.feed.epoch(self.progress.epoch, self.progress.step_in_epoch)
        if self.resume_rng is not None:
            torch.set_rng_state(self.resume_rng)
            self.resume_rng = None
        return batches

    def epoch_sums(self) -> tuple[float, float, float, float]:
        """This rank's figures of the epoch so far: loss x images, correct, images, seconds."""
        if self.sums is None:
            return (0.0, 0.0, 0.0, 0.0)
        return (*self.sums.tolist(), self.clock[1] + time.perf_counter() - self.clock[0])

    def run_epoch(self, bar) -> dict[str, Any]:
        """Train one epoch (or its rest); returns the epoch record, validation included."""
        cfg, p, steps = self.cfg, self.progress, len(self.feed)
        task = bar.add_task(f"epoch {p.epoch + 1}/{cfg.train.epochs}", total=steps, completed=p.step_in_epoch)
        log_every, save_every = cfg.train.log_every or max(1, self.steps_per_epoch() // 10), cfg.checkpoint.save_every
        # Sums stay on the device: read at the end of the epoch, not synchronised every step. Each
        # accumulation window's share is added once its step is known to be applied. Resumed mid-epoch,
        # they start from the checkpoint's, so the record covers the whole epoch as an uninterrupted run's does.
        before = p.epoch_sums if p.step_in_epoch and p.epoch_sums is not None else (0.0, 0.0, 0.0, 0.0)
        partial = bool(p.step_in_epoch) and p.epoch_sums is None  # a checkpoint from before the sums were saved
        self.sums = sums = torch.tensor(before[:3], dtype=torch.float64, device=self.device)
        self.clock, p.epoch_sums = (time.perf_counter(), before[3]), None
        window = torch.zeros(3, dtype=torch.float64, device=self.device)
        size = size_at(parse_schedule(cfg.data.resize_schedule), p.epoch)  # --resize-schedule; None: full size
        for hook in self.at_epoch_start:
            hook(p.epoch, p.step)
        for x, y in self._batches():
            # Every image of this batch failed to decode (--on-bad-file skip). Known limit: under torchrun
            # only this rank skips the batch, and the others wait for it in the gradient all-reduce.
            if not len(y):
                continue
            x, y = x.to(self.device, memory_format=self.memory_format, non_blocking=True), y.to(self.device)
            if size is not None:
                x = resize_batch(x, size)
            loss, logits, stepped = self.train_step(x, y)
            window[0] += loss.detach().double() * len(y)  # (a Python number is a kernel argument: no copy, no sync)
            window[1] += train_correct(logits, y).double()
            window[2] += len(y)
            bar.update(task, advance=1)
            if stepped is None:  # gradients still accumulating
                continue
            sums += torch.nan_to_num(window) * stepped  # a skipped NaN/Inf step is logged by the plan, not averaged in
            window.zero_()
            self._after_step(log_every, save_every, loss)
        if self.micro:  # batches left out of the feed (all-bad batches) ended the epoch inside a window
            self.micro = 0
            sums += torch.nan_to_num(window) * self.optimizer_step()
        if hasattr(self.optimizer, "sync_lookahead"):  # --lookahead: validate and save the slow weights (timm's
            self.optimizer.sync_lookahead()  # train.py syncs at each epoch end too)
        self.precision.check()
        loss_sum, correct, seen, elapsed = self.epoch_sums()
        self.sums = None
        # Added up over the ranks (their figures, not their averages: a rank may have skipped a batch)
        loss_sum, correct, seen, rate = self.session.sum([loss_sum, correct, seen, seen / max(elapsed, 1e-9)])
        record = {"kind": "epoch", "epoch": p.epoch + 1, "step": p.step,
                  "train_loss": loss_sum / max(1, seen), "train_top1": correct / max(1, seen),
                  "img_per_s": rate, "epoch_s": elapsed}
        if self.session.active:
            record["world_size"] = self.session.world
        if size is not None:
            record["train_img_size"] = size
        if partial:  # train_loss / train_top1 cover only the steps after the checkpoint
            record["train_partial"] = True
        return record | self.validate_epoch()

    def steps_per_epoch(self) -> int:
        return -(-len(self.feed) // self.cfg.optim.accum_steps)

    def _after_step(self, log_every: int, save_every: int, loss: torch.Tensor) -> None:
        """After an optimizer step: log, checkpoint, callbacks."""
        p = self.progress
        if p.step % log_every == 0:
            self.precision.check()  # deferred NaN/Inf checks are read here (one host synchronisation)
            self.log({"kind": "step", "epoch": p.epoch + 1, "step": p.step, "loss": self.session.mean(loss),
                      "lr": self.scheduler.get_last_lr()[0]})
        if save_every and p.step % save_every == 0:
            self.precision.check()
            self.save()
        for cb in (*self.callbacks, *self.session.callbacks()):
            cb(p.step)

    def validate_epoch(self) -> dict[str, Any]:
        """Validation of the raw weights, and of their EMA (keys prefixed ema_) with --ema."""
        if self.feed.val is None:
            return {}
        own = self.feed.val_own(self.session.rank, self.session.world)
        args = (self.feed.val, own, self.device, self.precision, self.memory_format, self.session)
        record = validate(self.forward, *args)
        if self.ema is not None:
            with self.ema.swapped_in(self.model):
                record |= {f"ema_{k}": v for k, v in validate(self.forward, *args).items()}
        return record

    def end_epoch(self, record: dict[str, Any]) -> None:
        """Log the epoch, keep the best weights (raw or, with --ema, their average: whichever validates
        better, recorded as `best`), and checkpoint it."""
        p = self.progress
        p.epoch, p.step_in_epoch = p.epoch + 1, 0
        if hasattr(self.scheduler, "epoch_end"):  # --sched plateau: before the checkpoint, which saves its state
            self.scheduler.epoch_end(record.get("val_loss", record["train_loss"]))
        self.thresholds = record.get("val_thresholds", self.thresholds)  # multilabel: saved with the weights
        source, score = max((("raw", epoch_score(record)), *((("ema", epoch_score(record, "ema_")),)
                                                              if "ema_val_loss" in record else ())),
                            key=lambda s: s[1])
        if score > p.best_top1:  # best first: the checkpoint after it then records it as the best so far
            record["best"] = source
            p.best_top1 = score
            with self.ema.swapped_in(self.model) if source == "ema" else contextlib.nullcontext():
                self.checkpointer.save_best(self.model, self.meta(record.get(f"{source}_val_thresholds")))
        self.log(record)
        _print_epoch(record, self.cfg.train.epochs)
        self.save()

    def early_stop(self) -> bool:
        """--early-stop N: whether the last N epochs did not improve on the best (counted from metrics.jsonl,
        so a resumed run counts the epochs before its restart too)."""
        patience = self.cfg.train.early_stop
        epochs = [r for r in read_metrics(self.run.path) if r.get("kind") == "epoch"]
        if not patience or len(epochs) <= patience or any("best" in r for r in epochs[-patience:]):
            return False
        self.log({"kind": "early_stop", "epoch": self.progress.epoch, "step": self.progress.step,
                  "patience": patience, "best_top1": self.progress.best_top1})
        console.print(f"early stop: no better validation score in the last {patience} epochs (--early-stop "
                      f"{patience}); best {self.progress.best_top1:.2%}")
        return True

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(record)
        write_scalars(self.writer, record)
        if self.tracker is not None:
            self.tracker.log(record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.tracker is not None:  # ends the MLflow run FAILED/KILLED if an exception is in flight
            self.tracker.close(self.progress.step)
        self.checkpointer.wait()  # background (async) saves
        self.session.close()

    def finish(self) -> TrainResult:
        """After the last epoch: the memory report and the skipped files, then the run is announced finished
        (governance's audit record and the run report subscribe: torchcls.consumers)."""
        if self.memory:
            self.memory.finish()
        if self.session.is_main:
            self._write_skipped()
        publish(RunFinished(self.cfg, self.run.path, self.result(), self.session.is_main, self.gov))
        if self.tracker is not None:  # report, metrics, config and best checkpoint as MLflow artifacts
            self.tracker.finish(self.result())
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
                           p.best_top1 if p.best_top1 >= 0 else None, p.step, interrupted,
                           tuple(sorted(ckpt.written)))


def epoch_score(record: dict[str, Any], prefix: str = "") -> float:
    """What "best" means for an epoch (tasks.best_score), for the raw weights or (prefix "ema_") their EMA."""
    if prefix:
        record = {k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix)}
    return best_score(record)


def _print_epoch(r: dict[str, Any], epochs: int) -> None:
    val = f"  val loss {r['val_loss']:.4f}  val top1 {r['val_top1']:.2%}" if "val_top1" in r else ""
    if "val_map" in r:  # multilabel
        val = f"  val loss {r['val_loss']:.4f}  val mAP {r['val_map']:.4f}  val F1 {r['val_f1']:.4f}"
    console.print(f"epoch {r['epoch']}/{epochs}  train loss {r['train_loss']:.4f}  "
                  f"train top1 {r['train_top1']:.2%}{val}  {r['img_per_s']:.0f} img/s")

"""The trainer: `train(cfg)` builds a `Trainer` and runs its epochs; each step fits on a screen.

build (data, model, precision, parallelize, rank-0 init, compile) -> resume -> run_epoch
(train_step per batch) -> validate -> end_epoch (log, checkpoint, best) -> finish.

Reproducibility: the data order, worker seeds and main-process RNG are re-seeded from
(seed, epoch) at each epoch start, and a mid-epoch checkpoint stores the step within
the epoch plus the RNG state; resuming replays the epoch's loader up to that step, so a
resumed run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls import governance
from torchcls.checkpoint.checkpointer import Checkpointer, Progress
from torchcls.checkpoint.files import CheckpointMeta
from torchcls.config import Config
from torchcls.console import console, progress_bar
from torchcls.data import build_data
from torchcls.data.mixing import build_mixing
from torchcls.data.shard_data import build_shard_data
from torchcls.data.shards import is_shard_source
from torchcls.devices import resolve_device
from torchcls.memory.recorder import recorder_for
from torchcls.models import ModelSpec, create_model
from torchcls.models.early_exit import exit_loss
from torchcls.precision.training import NonFiniteLoss, PrecisionPlan, apply_precision
from torchcls.training import rank0_init, sharding
from torchcls.training.compile import compile_for_training, should_compile
from torchcls.training.distributed import Session, setup, sync_buffers
from torchcls.training.feed import Feed, build_feed
from torchcls.training.memory import record_memory
from torchcls.training.optim import build_optimizer, warmup_cosine
from torchcls.training.parallel import parallelize
from torchcls.training.rundir import RunDir
from torchcls.training.tensorboard import open_writer, write_scalars
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


def train(cfg: Config, callbacks: Sequence[StepCallback] = ()) -> TrainResult:
    """Train per `cfg`; writes the run dir. Ctrl-C saves a checkpoint that --resume continues."""
    session = setup(cfg)  # torchrun ranks (ddp/fsdp2); inactive for --parallel none
    run = session.prepare_run(cfg)
    t = build(cfg, session, run, callbacks)
    if cfg.run.resume:
        t.resume()
    try:
        with progress_bar(cfg.train.progress) as bar:
            while t.progress.epoch < cfg.train.epochs:
                t.end_epoch(t.run_epoch(bar))
        if session.active:
            record_memory(run.path, t.model, t.optimizer, session)  # per-rank bytes vs full / world
    except KeyboardInterrupt:
        t.save()
        console.print(f"[yellow]interrupted at step {t.progress.step}; checkpoint saved. Continue with: "
                      f"torchcls train --config {run.path / 'config.toml'} --resume[/]")
        return t.result(interrupted=True)
    except NonFiniteLoss:  # --nonfinite stop: the failed step was not applied; keep the last good state
        t.save()
        raise
    finally:
        t.close()
    return t.finish()


# -- build ------------------------------------------------------------------------------------
def build(cfg: Config, session: Session, run: RunDir, callbacks: Sequence[StepCallback] = ()) -> Trainer:
    """Everything a run needs, in dependency order; governance refuses before any data is read."""
    if session.is_main:
        cfg.save_toml(run.path / "config.toml")
    device = resolve_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    gov = governance.begin(cfg, run.path)  # policy and data checks: refuses before any data is read
    data = _open_data(gov.data_config, cfg.train.seed, run, session)
    pre = data.preprocess
    spec = ModelSpec(cfg.model.name, len(data.classes), pre.channels, pre.img_size, cfg.model.drop_rate,
                     exits=cfg.model.exits, exit_threshold=cfg.model.exit_threshold,
                     drop_path_rate=cfg.model.drop_path)
    memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    compile_model, compile_note = should_compile(cfg.train, cfg.precision)
    model, precision = _build_model(cfg, spec, gov, data, session, run, device, memory_format,
                                    compile_model, compile_note)
    optimizer = build_optimizer(model, cfg.optim)
    feed = build_feed(cfg, data, session, device)
    steps_per_epoch = len(feed)
    scheduler = warmup_cosine(optimizer, int(cfg.optim.warmup_epochs * steps_per_epoch),
                              steps_per_epoch * cfg.train.epochs)
    checkpointer = Checkpointer(run.checkpoints, session, async_save=cfg.checkpoint.async_checkpoint,
                                lineage=lineage_stamp(gov), before_save=lambda m: sync_buffers(m, session))
    # The graph-break report runs two samples; only the map-style feed has a dataset to index.
    examples = data.train if feed.kind == "files" else [(torch.zeros(pre.channels, pre.img_size, pre.img_size), 0)] * 2
    forward = compile_for_training(model, examples, run.path, device, memory_format,
                                   report_breaks=not session.active) if compile_model else model
    memory = recorder_for(cfg.train, run.path, device)  # None unless --memory-report/--memory-snapshot
    mixing = build_mixing(cfg.data, cfg.optim.label_smoothing, len(data.classes),
                          sharding.per_rank_batch(cfg.data.batch_size, session), cfg.train.seed, session.rank)
    criterion = mixing.loss if mixing else nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
    return Trainer(cfg, session, run, gov, device, memory_format, data, spec, model, forward, precision,
                   optimizer, scheduler, criterion, feed, checkpointer,
                   [*callbacks, memory] if memory else list(callbacks), mixing, memory,
                   open_writer(run.path) if cfg.train.tensorboard else None)


def _build_model(cfg: Config, spec: ModelSpec, gov, data, session: Session, run: RunDir, device: torch.device,
                 memory_format: torch.memory_format, compile_model: bool,
                 compile_note: str) -> tuple[nn.Module, PrecisionPlan]:
    """The model, with governance hooks, precision and parallelism applied from outside it."""
    from_rank0 = rank0_init.applies(cfg.parallel, cfg.precision, gov.has_model_hooks)
    factory = partial(_new_model, spec, cfg.model.pretrained, run if session.is_main else None)
    if from_rank0:  # FSDP2: no rank holds the whole model on its device
        model, rank0_weights = rank0_init.build_on_meta(factory, session.rank)
        model = model.to(memory_format=memory_format)  # so that fsdp2 still refuses channels_last
    else:
        model = factory().to(device, memory_format=memory_format)
    model = gov.install(data, model)  # data/model hooks of the governed processing path
    # before parallelize: FP8 swaps Linear layers, which FSDP must see already swapped
    precision = apply_precision(model, cfg.precision, device, run, parallel=cfg.parallel.parallel,
                                compile=compile_model, compile_note=compile_note)
    model = parallelize(model, cfg.parallel, device)
    if from_rank0:
        rank0_init.materialize(model, rank0_weights, device, cfg.parallel)
    return model, precision


def _new_model(spec: ModelSpec, pretrained: str | None, run: RunDir | None) -> nn.Module:
    """The architecture `spec` names, from random init or from local --pretrained weights (recorded in the run)."""
    model = create_model(spec)
    if pretrained:
        from torchcls.models.pretrained import load_pretrained

        report = load_pretrained(model, pretrained, spec.num_classes)
        if run is not None:
            console.print(report.summary())
            (run.path / "pretrained.json").write_text(json.dumps(report.as_dict(), indent=2))
    return model


def _open_data(data_cfg, seed: int, run: RunDir, session: Session):
    """A DataBundle (folders, CSV, built-in and hf: sets) or a ShardBundle (WebDataset shards)."""
    data = build_shard_data(data_cfg, seed) if is_shard_source(data_cfg.source) else build_data(data_cfg, seed)
    data.log_skips_to(run.path, session.rank)  # files that fail in a worker are logged, not fatal (--on-bad-file skip)
    if session.is_main:
        data.write_splits(run.path)
        if data.skipped:
            console.print(f"[yellow]skipped {len(data.skipped)} unreadable file(s); listed in the report[/]")
    return data


def lineage_stamp(gov) -> dict[str, Any] | None:
    """What the checkpoints carry of the run's lineage (None: lineage is off for this run)."""
    if isinstance(getattr(gov, "lineage", None), dict):  # governance's stamp: run id, pinned chain head, policy
        return gov.lineage
    lineage_id = getattr(gov, "lineage_id", None)
    audit = getattr(gov, "audit", None)
    if lineage_id is None or audit is None:
        return None
    policy = getattr(gov, "policy", None)
    return {"run_id": lineage_id, "audit_log": str(audit.path.resolve()),
            "outputs": policy.outputs() if policy else {}}


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
        log_every, save_every = max(1, steps // 10), cfg.checkpoint.save_every
        # Sums stay on the device: read once at the end of the epoch, not synchronised every step.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        t0, seen = time.perf_counter(), 0
        for x, y in self._batches():
            if not len(y):  # every image of this batch failed to decode (--on-bad-file skip)
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

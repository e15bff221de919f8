"""The training loop: one public function, `train(cfg)`.

Reproducibility: the data order, worker seeds and main-process RNG are re-seeded from
(seed, epoch) at each epoch start, and a mid-epoch checkpoint stores the step within
the epoch plus the RNG state; resuming replays the epoch's loader up to that step, so a
resumed run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls import governance
from torchcls.config import Config
from torchcls.console import console, progress_bar
from torchcls.data import build_data, make_loader
from torchcls.data.loaders import reseed
from torchcls.devices import resolve_device
from torchcls.errors import UserError
from torchcls.models import ModelSpec, create_model
from torchcls.memory.recorder import recorder_for
from torchcls.models.early_exit import exit_loss
from torchcls.training.graph_breaks import report_graph_breaks
from torchcls.checkpoint.checkpointer import Checkpointer, Progress
from torchcls.checkpoint.files import CheckpointMeta
from torchcls.training import distributed, rank0_init, sharding
from torchcls.training.memory import record_memory
from torchcls.training.optim import build_optimizer, warmup_cosine
from torchcls.training.parallel import parallelize
from torchcls.precision.training import NonFiniteLoss, PrecisionPlan, apply_precision
from torchcls.training.rundir import RunDir

StepCallback = Callable[[int], None]  # called with the global step after each optimizer step


@dataclass
class TrainResult:
    run_dir: Path
    best_checkpoint: Path
    last_checkpoint: Path
    val_top1: float | None
    steps: int
    interrupted: bool = False


@torch.no_grad()
def validate(model: nn.Module, loader, device: torch.device, precision: PrecisionPlan,
             memory_format: torch.memory_format) -> dict[str, float]:
    model.eval()
    loss_sum, top1, top5, n = 0.0, 0, 0, 0
    for x, y in loader:
        x, y = x.to(device, memory_format=memory_format), y.to(device)
        with precision.autocast():
            logits = model(x).float()
        loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
        top1 += (topk[:, 0] == y).sum().item()
        top5 += (topk == y[:, None]).any(dim=1).sum().item()
        n += len(y)
    model.train()
    return {"val_loss": loss_sum / n, "val_top1": top1 / n, "val_top5": top5 / n}


def train(cfg: Config, callbacks: Sequence[StepCallback] = ()) -> TrainResult:
    """Train per `cfg`; writes the run dir. Ctrl-C saves a checkpoint that --resume continues."""
    session = distributed.setup(cfg)  # torchrun ranks (ddp/fsdp2); inactive for --parallel none
    run = session.prepare_run(cfg)
    if session.is_main:
        cfg.save_toml(run.path / "config.toml")
    device = resolve_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)

    gov = governance.begin(cfg, run.path)  # policy and data checks: refuses before any data is read
    data = build_data(gov.data_config, cfg.train.seed)
    if data.images.skipped and session.is_main:
        skipped = [{"file": f, "reason": r} for f, r in data.images.skipped]
        (run.path / "skipped_files.json").write_text(json.dumps({"skipped_files": skipped}, indent=2))
        console.print(f"[yellow]skipped {len(skipped)} unreadable file(s); listed in the report[/]")
    pre = data.preprocess
    spec = ModelSpec(cfg.model.name, len(data.classes), pre.channels, pre.img_size, cfg.model.drop_rate,
                     exits=cfg.model.exits, exit_threshold=cfg.model.exit_threshold)
    memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    from_rank0 = rank0_init.applies(cfg.parallel, cfg.precision, gov.has_model_hooks)
    if from_rank0:  # FSDP2: no rank holds the whole model on its device
        model, rank0_weights = rank0_init.build_on_meta(lambda: create_model(spec), session.rank)
        model = model.to(memory_format=memory_format)  # so that fsdp2 still refuses channels_last
    else:
        model = create_model(spec).to(device, memory_format=memory_format)
    model = gov.install(data, model)  # data/model hooks of the governed processing path
    # before parallelize: FP8 swaps Linear layers
    precision = apply_precision(model, _precision_options(cfg), device, run)
    model = parallelize(model, cfg.parallel, device)
    if from_rank0:
        rank0_init.materialize(model, rank0_weights, device, cfg.parallel)
    optimizer = build_optimizer(model, cfg.optim)

    seed = cfg.train.seed
    train_loader = sharding.train_loader(data.train, cfg.data.batch_size, cfg.data.workers, seed, session)
    val_loader = sharding.val_loader(data.val, cfg.data.batch_size * 2, cfg.data.workers, session)
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * cfg.train.epochs
    scheduler = warmup_cosine(optimizer, int(cfg.optim.warmup_epochs * steps_per_epoch), total_steps)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)

    def meta(p: Progress) -> CheckpointMeta:
        return CheckpointMeta(spec, data.classes, pre, cfg.to_dict(), p.epoch, p.step)

    ckpt = Checkpointer(run.checkpoints, session, async_save=cfg.checkpoint.async_checkpoint,
                        lineage=lineage_stamp(gov), before_save=lambda m: distributed.sync_buffers(m, session))

    def checkpoint(p: Progress) -> None:
        ckpt.save(model, optimizer, scheduler, p, meta(p), precision)

    p = Progress()
    resume_rng = None
    if cfg.run.resume:
        p, resume_rng = ckpt.resume(model, optimizer, scheduler, meta(Progress()), precision)
        run.truncate_metrics(p.step)
        world = f" (world size {session.world})" if session.active else ""
        console.print(f"resuming {run.path} at epoch {p.epoch + 1}, step {p.step}{world}")

    if precision.compile and not session.active:  # explain() runs forwards: not under FSDP's collectives
        report_graph_breaks(model, data.train, run.path, device, memory_format)
    forward = torch.compile(model) if precision.compile else model
    memory = recorder_for(cfg.train, run.path, device)  # None unless --memory-report/--memory-snapshot
    callbacks = [*callbacks, memory] if memory else callbacks
    writer = _tensorboard(run.path) if cfg.train.tensorboard else None
    log_every = max(1, steps_per_epoch // 10)
    model.train()
    try:
        with progress_bar(cfg.train.progress) as bar:
            while p.epoch < cfg.train.epochs:
                task = bar.add_task(f"epoch {p.epoch + 1}/{cfg.train.epochs}", total=steps_per_epoch,
                                    completed=p.step_in_epoch)
                reseed(train_loader, seed, p.epoch)
                batches = iter(train_loader)
                for _ in range(p.step_in_epoch):  # replay to the checkpointed position
                    next(batches)
                if resume_rng is not None:
                    torch.set_rng_state(resume_rng)
                    resume_rng = None
                t0, seen, loss_sum, correct = time.perf_counter(), 0, 0.0, 0
                for x, y in batches:
                    x, y = x.to(device, memory_format=memory_format, non_blocking=True), y.to(device)
                    with precision.autocast():
                        logits = forward(x)
                    loss, logits = exit_loss(criterion, logits, y, model)  # early-exit models: all exits
                    optimizer.zero_grad(set_to_none=True)
                    stepped = precision.backward_step(loss, optimizer, model, cfg.optim.grad_clip, p.step + 1)
                    scheduler.step()
                    p.step += 1
                    p.step_in_epoch += 1
                    if stepped:  # a skipped NaN/Inf step is logged by the plan, not averaged in
                        seen += len(y)
                        loss_sum += loss.item() * len(y)
                        correct += (logits.argmax(1) == y).sum().item()
                    bar.update(task, advance=1)
                    if p.step % log_every == 0:
                        record = {"kind": "step", "epoch": p.epoch + 1, "step": p.step, "loss": session.mean(loss),
                                  "lr": scheduler.get_last_lr()[0]}
                        run.log(record)
                        _tb(writer, record)
                    if cfg.checkpoint.save_every and p.step % cfg.checkpoint.save_every == 0:
                        checkpoint(p)
                    for cb in (*callbacks, *session.callbacks()):
                        cb(p.step)
                elapsed = time.perf_counter() - t0
                record = {"kind": "epoch", "epoch": p.epoch + 1, "step": p.step,
                          "train_loss": loss_sum / max(1, seen), "train_top1": correct / max(1, seen),
                          "img_per_s": seen / max(elapsed, 1e-9), "epoch_s": elapsed}
                record = session.reduce_epoch(record)
                if len(data.val) and session.active:
                    record |= sharding.validate(forward, val_loader, device, precision, memory_format, session)
                elif len(data.val):
                    record |= validate(forward, val_loader, device, precision, memory_format)
                p.epoch, p.step_in_epoch = p.epoch + 1, 0
                run.log(record)
                _tb(writer, record)
                _print_epoch(record, cfg.train.epochs)
                checkpoint(p)
                top1 = record.get("val_top1", record["train_top1"])
                if top1 > p.best_top1:
                    p.best_top1 = top1
                    ckpt.save_best(model, meta(p))
        if session.active:
            record_memory(run.path, model, optimizer, session)  # per-rank bytes vs full / world
    except KeyboardInterrupt:
        checkpoint(p)
        console.print(f"[yellow]interrupted at step {p.step}; checkpoint saved. Continue with: "
                      f"torchcls train --config {run.path / 'config.toml'} --resume[/]")
        return _result(run, p, interrupted=True)
    except NonFiniteLoss:  # --nonfinite stop: the failed step was not applied; keep the last good state
        checkpoint(p)
        raise
    finally:
        if writer is not None:
            writer.close()
        ckpt.wait()
        session.close()

    if memory:
        memory.finish()
    from torchcls.report import write_report

    if session.is_main:
        write_report(run.path)
    gov.finish(_result(run, p))  # redacted sample outputs, stamped checkpoints, audit record
    return _result(run, p)


def lineage_stamp(gov) -> dict[str, Any] | None:
    """What the checkpoints carry of the run's lineage (None: lineage is off for this run)."""
    lineage_id = getattr(gov, "lineage_id", None)
    audit = getattr(gov, "audit", None)
    if lineage_id is None or audit is None:
        return None
    policy = getattr(gov, "policy", None)
    return {"run_id": lineage_id, "audit_log": str(audit.path.resolve()),
            "outputs": policy.outputs() if policy else {}}


def _precision_options(cfg: Config):
    # apply_precision still reads compile and parallel beside the [precision] options.
    import types

    return types.SimpleNamespace(**dataclasses.asdict(cfg.precision), compile=cfg.train.compile,
                                 parallel=cfg.parallel.parallel)


def _result(run: RunDir, p: Progress, interrupted: bool = False) -> TrainResult:
    best = run.checkpoints / "best.safetensors"
    return TrainResult(run.path, best if best.exists() else run.checkpoints / "last.safetensors",
                       run.checkpoints / "last.safetensors", p.best_top1 if p.best_top1 >= 0 else None,
                       p.step, interrupted)


def _print_epoch(r: dict[str, Any], epochs: int) -> None:
    val = f"  val loss {r['val_loss']:.4f}  val top1 {r['val_top1']:.2%}" if "val_top1" in r else ""
    console.print(f"epoch {r['epoch']}/{epochs}  train loss {r['train_loss']:.4f}  "
                  f"train top1 {r['train_top1']:.2%}{val}  {r['img_per_s']:.0f} img/s")


def _tensorboard(run_path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("--tensorboard needs the 'tensorboard' package: pip install tensorboard") from None
    return SummaryWriter(str(run_path / "tensorboard"))


def _tb(writer, record: dict[str, Any]) -> None:
    if writer is None:
        return
    for key, value in record.items():
        if key not in ("kind", "epoch", "step") and isinstance(value, (int, float)):
            writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

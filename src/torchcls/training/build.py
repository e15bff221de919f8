"""`train(cfg)`: build a Trainer from the config, then run its epochs.

build: data (a DataBundle or a ShardBundle, and the feed that batches it), model (random init or
--pretrained, governance hooks, precision, parallelism, rank-0 init), optimizer and schedule,
mixing, checkpointer, compile. The run is announced (torchcls.events.RunStarted) before any data is
read: governance, subscribed, refuses it there or guards it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
from torch import nn

from torchcls.checkpoint.checkpointer import Checkpointer
from torchcls.checkpoint.pretrained import PretrainedSource, model_for, pretrained_model, resolve_pretrained
from torchcls.config import Config, ModelConfig, check_ranges, resume_command
from torchcls.console import console, progress_bar
from torchcls.data import build_data
from torchcls.data.mixing import build_mixing
from torchcls.data.preprocess import PretrainedInput
from torchcls.data.preprocess import describe as describe_preprocess
from torchcls.data.refusals import collect
from torchcls.data.shard_data import build_shard_data
from torchcls.data.shards import is_shard_source
from torchcls.devices import resolve_device
from torchcls.errors import UserError
from torchcls.events import RunStarted, Unguarded, publish
from torchcls.machine import (
    CpuActivity,
    ThreadChoice,
    apply_threads,
    choose_threads,
    cpu_model,
    describe_machine,
)
from torchcls.memory.recorder import recorder_for
from torchcls.models import ModelSpec, create_model
from torchcls.precision.hardware import PrecisionChoice
from torchcls.precision.training import NonFiniteLoss, PrecisionPlan, apply_precision, check_precision_options
from torchcls.run_files import write_text_atomic
from torchcls.tasks import multilabel_criterion
from torchcls.training import rank0_init, sharding
from torchcls.training.class_weights import loss_weights
from torchcls.training.compiled_forward import compile_for_training, should_compile
from torchcls.training.distributed import Session, setup, sync_buffers
from torchcls.training.ema import WeightEma
from torchcls.training.feed import build_feed
from torchcls.training.freeze import apply_freeze
from torchcls.training.init import FirstBiasFreeze, freeze_first_conv, initialise, parse_init
from torchcls.training.optim import build_optimizer, build_scheduler
from torchcls.training.parallel import parallelize
from torchcls.training.rank_memory import record_memory
from torchcls.training.resize import check_schedule
from torchcls.training.resume_options import Finished, finished_run, option_changes
from torchcls.training.rundir import RunDir, check_skipped_files
from torchcls.training.selective import selective_backprop
from torchcls.training.step_choice import STATE_FILE as STEP_STATE
from torchcls.training.step_choice import StepChoice, choose_step
from torchcls.training.tensorboard import open_writer
from torchcls.training.thread_tuning import read_record, recorded_reservation, tuner_for
from torchcls.training.tracking import open_tracker
from torchcls.training.trainer import StepCallback, Trainer, TrainResult


def train(cfg: Config, callbacks: Sequence[StepCallback] = ()) -> TrainResult:
    """Train per `cfg`; writes the run dir. Ctrl-C saves a checkpoint that --resume continues.
    A run that fails before its first step removes the run dir it created (nothing else), so the
    same command can be run again once the cause is fixed."""
    _check_options(cfg)  # before a run dir exists: a wrong value leaves nothing to clean up
    session = setup(cfg)  # torchrun ranks (ddp/fsdp2); inactive for --parallel none
    run = session.prepare_run(cfg)
    if cfg.run.resume and (done := finished_run(run.path, cfg)) is not None:
        return _already_finished(done, run, session)
    t = None
    try:
        t = build(cfg, session, run, callbacks)
        if cfg.run.resume:
            t.resume()
        return _run_epochs(t, cfg, session, run)
    except BaseException as e:
        first_step_not_taken = t is None or t.progress.step == 0
        if session.is_main and not cfg.run.resume and first_step_not_taken and run.discard_failed_start():
            console.print(f"[yellow]removed {run.path}: the run stopped before its first step[/]")
        if (failure := run.write_failure(e)) is not None:  # the run dir cannot be written: which file, what is intact
            raise failure from None
        raise
    finally:
        if t is not None:  # the loader workers end with the run, whatever holds the trainer (a traceback, a caller)
            t.feed.release()


def _already_finished(done: Finished, run: RunDir, session: Session) -> TrainResult:
    """--resume of a complete run: nothing is built or trained; say so (rank 0) and describe the run."""
    if session.is_main:
        console.print(done.message, highlight=False)
    session.close()
    last, best = run.checkpoints / "last.safetensors", run.checkpoints / "best.safetensors"
    return TrainResult(run.path, best if best.is_file() else last, last, done.best_top1, done.step)


def _run_epochs(t: Trainer, cfg: Config, session: Session, run: RunDir) -> TrainResult:
    try:
        with progress_bar(cfg.train.progress) as bar:
            while t.progress.epoch < cfg.train.epochs and not t.early_stop():
                t.end_epoch(t.run_epoch(bar))
        if session.active:
            record_memory(run.path, t.model, t.optimizer, session)  # per-rank bytes vs full / world
    except KeyboardInterrupt:
        t.save()
        console.print(f"[yellow]interrupted at step {t.progress.step}; checkpoint saved. Continue with: "
                      f"{resume_command(run.path, cfg)}[/]", highlight=False)
        return t.result(interrupted=True)
    except NonFiniteLoss:  # --nonfinite stop: the failed step was not applied; keep the last good state
        t.save()
        raise
    finally:
        t.close()
    return t.finish()


def build(cfg: Config, session: Session, run: RunDir, callbacks: Sequence[StepCallback] = ()) -> Trainer:
    """Everything a run needs, in dependency order; governance refuses before any data is read."""
    activity = CpuActivity()  # other processes' CPU use while the data loads: the threads leave their CPUs
    source = _resolve_pretrained(cfg)  # before config.toml is written: it may name the weights' architecture
    saved = run.path / "config.toml"  # before it is overwritten: what a resume may change
    changes = option_changes(saved, cfg) if cfg.run.resume and saved.is_file() else {}
    if cfg.run.resume:  # refused now, not after the last epoch (where governance rewrites it)
        check_skipped_files(run.path)
    if session.is_main:
        cfg.save_toml(run.path / "config.toml")
    device = resolve_device(cfg.train.device)
    if cfg.train.threads:  # an explicit count holds for the data loading too; the default waits for the feed
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    started = RunStarted(cfg, run.path)
    publish(started)  # governance checks the policy and the data here: a refusal raises before any data is read
    gov = started.guard or Unguarded(cfg.data)
    with collect():  # the unreadable files of every check before training (headers, sizes, decodes) in one refusal
        data = _open_data(gov.data_config, cfg.train.seed, run, session, source.input if source else None)
        gov.install_data(data)  # tensor hooks first: every feed, the in-memory cache too, reads through them
        feed = build_feed(cfg, data, session, device)
    pre = data.preprocess
    spec = ModelSpec(cfg.model.name, len(data.classes), pre.channels, pre.img_size, cfg.model.drop_rate,
                     exits=cfg.model.exits, exit_threshold=cfg.model.exit_threshold,
                     drop_path_rate=cfg.model.drop_path)
    # machine.json of the run resumed, read before it is rewritten: the counts it started with and measured
    recorded = read_record(run.path / "machine.json") if cfg.run.resume and not cfg.train.threads else {}
    threads = _set_threads(cfg, feed, activity, recorded)  # before the step is timed: at the run's thread count
    step = _choose_step(cfg, spec, session, run, device, threads)
    memory_format = torch.channels_last if step.channels_last else torch.contiguous_format
    compile_model, compile_note = should_compile(cfg.train, cfg.precision)
    model, precision = _build_model(cfg, spec, gov, data, session, run, device, memory_format,
                                    compile_model, compile_note, source, step.precision)
    _record_machine(run, session, precision, threads)
    optimizer = build_optimizer(model, cfg.optim)
    steps_per_epoch = _optimizer_steps_per_epoch(len(feed), cfg.optim.accum_steps)
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch, cfg.train.epochs)
    tuner = tuner_for(threads, run.path / "machine.json", steps_per_epoch, recorded, single_cpu_process=(
        device.type == "cpu" and not session.active and os.environ.get("LOCAL_WORLD_SIZE", "1") in ("", "1")))
    ema = WeightEma(model, cfg.optim.ema) if cfg.optim.ema else None
    checkpointer = Checkpointer(run.checkpoints, session, async_save=cfg.checkpoint.async_checkpoint,
                                lineage=lineage_stamp(gov), before_save=lambda m: sync_buffers(m, session),
                                extras={"ema": ema} if ema else None, unsafe_unpickle=cfg.checkpoint.unsafe_unpickle)
    _choose_nonfinite_check(cfg.precision.nonfinite_check, precision, optimizer, device)
    # The graph-break report runs two samples; only the map-style feed has a dataset to index.
    examples = data.train if feed.kind == "files" else [(torch.zeros(pre.channels, pre.img_size, pre.img_size), 0)] * 2
    forward = compile_for_training(model, examples, run.path, device, memory_format,
                                   report_breaks=not session.active) if compile_model else model
    memory = recorder_for(cfg.train, run.path, device)  # None unless --memory-report/--memory-snapshot
    mixing = build_mixing(cfg.data, cfg.optim.label_smoothing, len(data.classes),
                          sharding.per_rank_batch(cfg.data.batch_size, session), cfg.train.seed, session.rank,
                          multilabel=cfg.data.task == "multilabel")
    criterion = mixing.loss if mixing else nn.CrossEntropyLoss(weight=loss_weights(cfg, data, mixing, device),
                                                               label_smoothing=cfg.optim.label_smoothing)
    if cfg.data.task == "multilabel":  # BCE (torchcls.tasks)
        criterion = multilabel_criterion(cfg, data, mixing)
    at_epoch_start = [FirstBiasFreeze(model, n)] if (n := cfg.optim.freeze_first_bias_after_epochs) else []
    if tuner:  # given the global step before each epoch's first batch: a resumed run's too
        at_epoch_start.append(lambda _epoch, step: tuner.begin(step))
    tracker = open_tracker(cfg, run.path) if session.is_main else None  # last: a refused store leaves nothing
    t = Trainer(cfg, session, run, gov, device, memory_format, data, spec, model, forward, precision,
                optimizer, scheduler, criterion, feed, checkpointer,
                # the tuner first: a callback that stops the run at the tuner's step comes after its decision
                [*([tuner] if tuner else []), *callbacks, *([memory] if memory else [])], mixing, memory,
                open_writer(run.path) if cfg.train.tensorboard else None, resume_changes=changes, ema=ema,
                tracker=tracker, at_epoch_start=at_epoch_start, selective=selective_backprop(cfg.optim))
    return t


def _check_options(cfg: Config) -> None:
    """Options whose values are wrong whatever the data: refused before anything is read."""
    if cfg.data.batch_size < 1:
        raise UserError(f"--batch-size {cfg.data.batch_size}: give the number of images per training step, >= 1 "
                        "(e.g. 128; with torchrun, a multiple of the number of processes)")
    if cfg.train.log_every < 0:
        raise UserError(f"--log-every {cfg.train.log_every}: give a number of steps >= 1, or 0 for ten records an "
                        "epoch")
    if cfg.optim.accum_steps < 1:
        raise UserError(f"--accum-steps {cfg.optim.accum_steps}: give the number of micro-batches per optimizer "
                        "step, >= 1 (1 = no accumulation)")
    if cfg.optim.ema and not 0.0 < cfg.optim.ema < 1.0:
        raise UserError(f"--ema {cfg.optim.ema}: give a decay in (0, 1), e.g. 0.999, or 0 for no EMA")
    if cfg.train.early_stop < 0:
        raise UserError(f"--early-stop {cfg.train.early_stop}: give a number of epochs >= 1, or 0 to train all "
                        "--epochs")
    check_ranges(cfg)  # (set_option checked every option set from a file or flag; this, one set in Python)
    check_schedule(cfg.data.resize_schedule, cfg.train.epochs, cfg.data.img_size)
    check_precision_options(cfg.precision, cfg.parallel.parallel)
    _check_training_options(cfg)


def _check_training_options(cfg: Config) -> None:
    """--init, --lookahead, --freeze-first-bias-after-epochs and --selective-backprop: the combinations they are
    defined for."""
    if parse_init(cfg.model.init) and cfg.model.pretrained:
        raise UserError(f"--init {cfg.model.init} replaces weights, --pretrained {cfg.model.pretrained} loads them: "
                        "give one of the two")
    if cfg.optim.freeze_first_bias_after_epochs < 0:
        raise UserError(f"--freeze-first-bias-after-epochs {cfg.optim.freeze_first_bias_after_epochs}: give a number "
                        "of epochs >= 1, or 0 to train the bias throughout")
    if cfg.parallel.parallel != "none" and (cfg.optim.lookahead or cfg.optim.freeze_first_bias_after_epochs):
        # DCP's optimizer state dict does not know timm's wrapper, and DDP expects a gradient for every
        # parameter it registered: a bias frozen mid-run would stop its all-reduce.
        raise UserError(f"--lookahead and --freeze-first-bias-after-epochs are for one process; with --parallel "
                        f"{cfg.parallel.parallel} leave them at 0")
    _check_selective_backprop(cfg)


def _check_selective_backprop(cfg: Config) -> None:
    o = cfg.optim
    if not o.selective_backprop:
        return
    flag = f"--selective-backprop {o.selective_backprop}"
    if not 0.0 < o.selective_backprop < 1.0 or o.selective_backprop_after_epochs < 0:
        raise UserError(f"{flag} --selective-backprop-after-epochs {o.selective_backprop_after_epochs}: give the "
                        "fraction of each batch to train on, in (0, 1) (0 = all), from an epoch >= 0 "
                        "(e.g. --selective-backprop 0.5 --selective-backprop-after-epochs 2)")
    # Its images are ranked by their loss against one hard label, from one output: not defined for blended
    # labels, multilabel targets or several exits. And one process: not tested under torchrun.
    for given, what in ((cfg.data.mixup or cfg.data.cutmix, "--mixup/--cutmix"),
                        (cfg.data.task == "multilabel", "--task multilabel"), (cfg.model.exits, "--exits"),
                        (cfg.parallel.parallel != "none", f"--parallel {cfg.parallel.parallel}")):
        if given:
            raise UserError(f"{flag} ranks each image by its loss against its one label, on one process: "
                            f"leave it at 0 with {what}")


def _set_threads(cfg: Config, feed, activity: CpuActivity, recorded: dict[str, Any]) -> ThreadChoice:
    """--threads, or the quota- and load-aware default once the feed says whether DataLoader workers share the
    CPUs (the in-memory feed has none). A resume keeps the run's count: results depend on it, bit for bit (and
    training/thread_tuning.py re-applies the count measured later in the run at the step it changed)."""
    threads = recorded.get("torch_threads")
    if cfg.run.resume and not cfg.train.threads and isinstance(threads, int) and threads > 0:
        return apply_threads(ThreadChoice(threads, "the count this run started with (resume)",
                                          recorded_reservation(recorded)))
    workers = 0 if feed.kind == "memory" else cfg.data.workers
    busy = activity.busy() if not cfg.train.threads else (0, "")
    return apply_threads(choose_threads(cfg.train.threads, workers, busy=busy))


def _choose_step(cfg: Config, spec: ModelSpec, session: Session, run: RunDir, device: torch.device,
                 threads: ThreadChoice) -> StepChoice:
    """The precision and memory layout of the training step (timed on a CPU: training/step_choice.py),
    recorded in step_choice.json, which a resumed run reads back."""
    state = run.path / STEP_STATE
    step = choose_step(
        cfg.precision.precision, cfg.train.channels_last, device, new_model=partial(create_model, spec),
        make_optimizer=lambda m: build_optimizer(m, cfg.optim), classes=spec.num_classes,
        shape=(sharding.per_rank_batch(cfg.data.batch_size, session), spec.in_chans, spec.img_size, spec.img_size),
        distributed=session.active, state=state if cfg.run.resume else None,
        describe={"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(),
                  "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "threads": threads.threads,
                  "torch": torch.__version__, "model": spec.name, "optimizer": cfg.optim.optimizer})
    if session.is_main:
        write_text_atomic(state, json.dumps(step.record(), indent=2))
        console.print(step.line(), highlight=False)
    return step


def _record_machine(run: RunDir, session: Session, precision: PrecisionPlan, threads: ThreadChoice) -> None:
    """machine.json: the CPU, cores and quota, threads and precision this run ran with (benchmarks record the
    same fields)."""
    if session.is_main:
        console.print(f"threads {threads.threads}: {threads.reason}", highlight=False)
        machine = describe_machine(precision.name, threads)
        write_text_atomic(run.path / "machine.json", json.dumps(machine, indent=2))


def _choose_nonfinite_check(when: str, precision: PrecisionPlan, optimizer, device: torch.device) -> None:
    """--nonfinite-check: deferred (no host synchronisation per step) where the optimizer can skip an
    update from a device flag; auto defers on CUDA only."""
    if when == "deferred" or (when == "auto" and device.type == "cuda"):
        if not precision.defer_checks(optimizer) and when == "deferred":
            console.print("[yellow]--nonfinite-check deferred needs a fused optimizer (adamw, adam or sgd) and no "
                          "grad scaler (fp16); checking every step instead[/]")


def _optimizer_steps_per_epoch(batches: int, accum_steps: int) -> int:
    if accum_steps > batches:
        raise UserError(f"--accum-steps {accum_steps} is more than the {batches} batches of an epoch: no optimizer "
                        f"step would see a full window. Use --accum-steps <= {batches}, or a smaller --batch-size")
    return -(-batches // accum_steps)


def _build_model(cfg: Config, spec: ModelSpec, gov, data, session: Session, run: RunDir, device: torch.device,
                 memory_format: torch.memory_format, compile_model: bool, compile_note: str,
                 source: PretrainedSource | None = None, choice: PrecisionChoice | None = None,
                 ) -> tuple[nn.Module, PrecisionPlan]:
    """The model, with governance hooks, precision and parallelism applied from outside it."""
    from_rank0 = rank0_init.applies(cfg.parallel, cfg.precision, gov.has_model_hooks)
    factory = partial(_new_model, spec, source, run if session.is_main else None, data.classes,
                      cfg.checkpoint.unsafe_unpickle)
    if parse_init(cfg.model.init):  # --init whiten/dirac: part of building the weights (rank 0's, under FSDP2)
        factory = partial(_initialised, factory, cfg.model, data, cfg.train.seed, session.is_main)
    if from_rank0:  # FSDP2: no rank holds the whole model on its device
        model, rank0_weights = rank0_init.build_on_meta(factory, session.rank)
        model = model.to(memory_format=memory_format)  # so that fsdp2 still refuses channels_last
    else:
        model = factory().to(device, memory_format=memory_format)
    if (frozen := apply_freeze(model, cfg.model.freeze)) and session.is_main:  # before DDP wraps it
        console.print(frozen)
    if cfg.model.freeze_first_conv and (frozen := freeze_first_conv(model)) and session.is_main:
        console.print(frozen)
    model = gov.install_model(model)  # model hooks of the governed processing path
    # before parallelize: FP8 swaps Linear layers, which FSDP must see already swapped
    pre = data.preprocess  # FP8 measures each layer's tokens per step from one batch of this shape
    batch = (sharding.per_rank_batch(cfg.data.batch_size, session), pre.channels, pre.img_size, pre.img_size)
    precision = apply_precision(model, cfg.precision, device, run, parallel=cfg.parallel.parallel,
                                compile=compile_model, compile_note=compile_note, example_shape=batch, choice=choice)
    model = parallelize(model, cfg.parallel, device)
    if from_rank0:
        rank0_init.materialize(model, rank0_weights, device, cfg.parallel)
    return model, precision


def _initialised(factory, model_cfg: ModelConfig, data, seed: int, verbose: bool) -> nn.Module:
    """The model `factory` builds, then --init applied to it (seeded by --seed, never the global RNG)."""
    model = factory()
    for line in initialise(model, parse_init(model_cfg.init), data, seed, model_cfg.whiten_eps):
        if verbose:
            console.print(line, highlight=False)
    return model


def _resolve_pretrained(cfg: Config) -> PretrainedSource | None:
    """--pretrained located (hub weights fetched into the cache); --model left at its default becomes the
    architecture the weights name (a hub config)."""
    if not cfg.model.pretrained:
        return None
    source = resolve_pretrained(cfg.model.pretrained, cfg.model.name)
    cfg.model.name = model_for(cfg.model.name, source, default=ModelConfig.name)
    return source


def _new_model(spec: ModelSpec, pretrained: PretrainedSource | None, run: RunDir | None,
               classes: list[str], unsafe_unpickle: bool = False) -> nn.Module:
    """The architecture `spec` names, from random init or from --pretrained weights (recorded in the run)."""
    if not pretrained:
        return create_model(spec)
    model, report = pretrained_model(spec, pretrained, classes, unsafe_unpickle)  # timm's own loading for timm models
    if run is not None:
        console.print(report.summary())
        write_text_atomic(run.path / "pretrained.json", json.dumps(report.as_dict(), indent=2))
    return model


def _open_data(data_cfg, seed: int, run: RunDir, session: Session, pretrained: PretrainedInput | None = None):
    """A DataBundle (folders, CSV, built-in and hf: sets) or a ShardBundle (WebDataset shards); their
    preprocessing follows `pretrained` (the backbone's data config) where no flag overrides it."""
    shards = is_shard_source(data_cfg.source)
    data = (build_shard_data if shards else build_data)(data_cfg, seed, pretrained)
    data.log_skips_to(run.path, session.rank)  # files that fail in a worker are logged, not fatal (--on-bad-file skip)
    if session.is_main:
        data.write_splits(run.path)
        write_text_atomic(run.path / "preprocess.json", json.dumps(
            {"preprocess": asdict(data.preprocess), "from": data.preprocess_from}, indent=2))
        if pretrained is not None:
            console.print(describe_preprocess(data.preprocess, data.preprocess_from))
        if data.skipped and data_cfg.on_bad_file == "skip":  # under error they are refused below
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

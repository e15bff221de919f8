"""What a resumed run may change: options that would make the checkpoint a different run are
refused, the learning rate and weight decay are applied to the restored optimizer and schedule
(which would otherwise silently keep the old values while config.toml claims the new ones), and
every change is recorded in metrics.jsonl. A run that has trained all its epochs has nothing to resume:
it says so, and how to train further.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.checkpoint.files import read_meta
from torchcls.config import SECTIONS, Config, load_toml
from torchcls.errors import UserError
from torchcls.training.rundir import read_metrics

# Changing one of these would resume other data or another order of batches. (Another --model is
# refused by the checkpoint itself; another --parallel or world size is what DCP resharding is for.)
FIXED = {"data": ("source", "root", "val_data", "val_fraction", "img_size", "channels", "batch_size",
                  "image_column", "label_column", "in_memory", "task", "balanced_sampler"),
         "model": ("exits", "drop_rate", "drop_path", "freeze", "init", "whiten_eps", "freeze_first_conv"),
         # from "optimizer" on: the restored optimizer's state and its groups' lr_scale and lookahead_* would
         # silently keep the old ones; selective_backprop*: another choice of the images each step trains on
         "optim": ("accum_steps", "ema", "optimizer", "layer_decay", "head_lr", "bn_bias_lr_scale", "lookahead",
                   "lookahead_alpha", "selective_backprop", "selective_backprop_after_epochs"),
         "train": ("seed",)}


def option_changes(saved: Path, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """{"section.key": (before, now)} between the run's config.toml and `cfg`; refuses fixed ones."""
    before = load_toml(saved)
    fields = {f"{s}.{f.name}": f for s, cls in SECTIONS.items() if s != "run" for f in dataclasses.fields(cls)}
    changes = {k: (getattr(getattr(before, k.split(".")[0]), f.name), getattr(getattr(cfg, k.split(".")[0]), f.name))
               for k, f in fields.items()}
    changes = {k: v for k, v in changes.items() if v[0] != v[1]}
    fixed = [k for k in changes if k.split(".")[1] in FIXED.get(k.split(".")[0], ())]
    if fixed:
        flag = {k: "--" + (f.metadata.get("flag") or f.name).replace("_", "-") for k, f in fields.items()}
        listing = ", ".join(f"{flag[k]} {changes[k][0]!r} -> {changes[k][1]!r}" for k in fixed)
        raise UserError(f"--resume: {listing} would not continue the run in {saved.parent} (other data, model or "
                        "batch order); resume with the run's options, or start a new run (another --name)")
    return changes


@dataclass
class Finished:
    """A --resume of a run that has nothing left to train: what it holds and what the user can do."""
    epoch: int
    step: int
    best_top1: float | None
    message: str


def finished_run(run_path: Path, cfg: Config) -> Finished | None:
    """None while the run has epochs left; else why it is complete and the command that trains further.
    The last checkpoint's metadata says how many epochs it finished (an interrupted epoch is not counted)."""
    last = run_path / "checkpoints" / "last.safetensors"
    if not last.is_file():
        return None
    meta = read_meta(last)
    records = read_metrics(run_path)
    stopped = next((r for r in reversed(records) if r.get("kind") == "early_stop"), None)
    stopped_early = stopped is not None and stopped.get("epoch") == meta.epoch and cfg.train.early_stop
    if meta.epoch < cfg.train.epochs and not stopped_early:
        return None
    best = max((r["val_top1"] for r in records if r.get("kind") == "epoch" and "val_top1" in r), default=None)
    command = f"torchcls train --config {run_path / 'config.toml'} --resume"
    if stopped_early:
        why = (f"it stopped early after epoch {meta.epoch} (--early-stop {cfg.train.early_stop}: no better "
               "validation score)")
        further = f"{command} --early-stop 0 --epochs {max(cfg.train.epochs, meta.epoch + 1)}"
    else:
        why = f"it has trained {meta.epoch} of {cfg.train.epochs} epoch(s)"
        further = f"{command} --epochs {max(2 * meta.epoch, meta.epoch + 1)}"
    return Finished(meta.epoch, meta.step, best, f"{run_path} is complete: {why}, step {meta.step}"
                    + (f", best val top1 {best:.2%}" if best is not None else "") + "; nothing to resume. To train "
                    f"further, raise --epochs (the schedule is stretched to the new length): {further}")


def apply_optim_changes(optimizer, scheduler, changes: dict[str, tuple[Any, Any]], schedule_restored: bool,
                        built_weight_decays: list[float]) -> None:
    """Put a changed --lr / --weight-decay into the restored optimizer and learning-rate schedule.
    `schedule_restored`: False when the schedule was built from the new options and only its position
    was restored (DCP checkpoints keep the rates, not the schedule): its base is already the new one.
    `built_weight_decays`: each group's weight decay as built from the new options, before the
    checkpoint's state replaced it (the restored groups of a run without decay all hold 0, so they
    cannot tell which group is decayed)."""
    if "optim.lr" in changes:
        old, new = changes["optim.lr"]
        scale = new / old if old else 1.0
        if schedule_restored:
            scheduler.base_lrs = [b * scale for b in scheduler.base_lrs]
        for group in optimizer.param_groups:
            group["lr"] *= scale
            if "initial_lr" in group:
                group["initial_lr"] *= scale
    if "optim.weight_decay" in changes:
        for group, decay in zip(optimizer.param_groups, built_weight_decays, strict=True):
            group["weight_decay"] = decay


def record(changes: dict[str, tuple[Any, Any]], step: int) -> dict[str, Any]:
    """The metrics.jsonl entry of a resume: every option that changed (all of them take effect)."""
    return {"kind": "resume", "step": step, "changed": {k: {"before": b, "now": n} for k, (b, n) in changes.items()}}

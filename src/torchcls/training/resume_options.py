"""What a resumed run may change: options that would make the checkpoint a different run are
refused, the learning rate and weight decay are applied to the restored optimizer and schedule
(which would otherwise silently keep the old values while config.toml claims the new ones), and
every change is recorded in metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torchcls.config import SECTIONS, Config, load_toml
from torchcls.errors import UserError

# Changing one of these would resume other data or another order of batches. (Another --model is
# refused by the checkpoint itself; another --parallel or world size is what DCP resharding is for.)
FIXED = {"data": ("source", "root", "val_data", "val_fraction", "img_size", "channels", "batch_size",
                  "image_column", "label_column", "in_memory", "task", "balanced_sampler"),
         "model": ("exits", "drop_rate", "drop_path", "freeze"),
         "optim": ("accum_steps", "ema", "optimizer", "layer_decay", "head_lr"),  # the last three: the restored
         # optimizer's state and its groups' lr_scale would silently keep the old ones
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

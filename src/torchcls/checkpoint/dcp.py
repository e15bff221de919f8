"""Sharded checkpoints with torch.distributed.checkpoint (DCP), and their consolidation.

Layout in runs/<name>/checkpoints/:
  last.dcp/           DCP: each rank writes its own shards (.distcp) + .metadata; meta.json
                      holds the model spec and progress. Loading reshards to any world size
                      (2 → 1, 1 → 2, DDP ↔ FSDP2): DCP addresses tensors by name and global
                      offsets, not by rank.
  last.safetensors    the same weights consolidated into one file (rank 0), and
  best.safetensors    so evaluate / predict / export / serve read them like any run's.
The DCP state holds tensors only (weights, optimizer moments, progress counters, learning
rates, RNG): no pickled objects are written or loaded. Every save goes to a temporary dir
that rank 0 renames into place once all ranks finished: a crash mid-save keeps the old one.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from torchcls.errors import UserError
from torchcls.checkpoint.files import META_KEY, CheckpointMeta, atomic_write, model_state
from torchcls.training.distributed import Session, sync_buffers

LAST, TMP, OLD, META = "last.dcp", ".last.dcp.tmp", ".last.dcp.old", "meta.json"


def has_checkpoint(ckpt_dir: Path) -> bool:
    return (ckpt_dir / LAST / ".metadata").is_file() or (ckpt_dir / "last.state.pt").is_file()


def dcp_step(ckpt_dir: Path) -> int | None:
    meta = ckpt_dir / LAST / META
    return json.loads(meta.read_text())["step"] if meta.is_file() and (ckpt_dir / LAST / ".metadata").is_file() \
        else None


def resumes_from_dcp(ckpt_dir: Path, session: Session) -> bool:
    """Ranks always resume through DCP; a single process does when its DCP state is the newer one."""
    if session.active:
        return True
    step = dcp_step(ckpt_dir)
    legacy = ckpt_dir / "last.state.pt"
    if step is None:
        return False
    if not legacy.is_file():
        return True
    return step > torch.load(legacy, map_location="cpu", weights_only=True)["step"]


# -- consolidated weights ------------------------------------------------------------------
def full_model_state(model: nn.Module, session: Session) -> dict[str, torch.Tensor] | None:
    """All ranks call this (FSDP2 gathers shards); rank 0 gets the full CPU state dict."""
    if not session.active:
        return model_state(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.contiguous().clone() for k, v in sd.items()} if session.is_main else None


def save_weights(path: Path, model: nn.Module, meta: CheckpointMeta, session: Session) -> None:
    state = full_model_state(model, session)
    if session.is_main:
        atomic_write(path, lambda tmp: save_file(state, tmp, metadata={META_KEY: meta.to_json()}))


# -- sharded training state -----------------------------------------------------------------
def _state(model: nn.Module, optimizer, scheduler, progress: Any) -> tuple[dict[str, Any], list]:
    osd = get_optimizer_state_dict(model, optimizer)  # creates zero moments on a fresh optimizer
    return {
        "model": get_model_state_dict(model),
        "optim": {"state": osd["state"]},
        "progress": torch.tensor([progress.epoch, progress.step, progress.step_in_epoch], dtype=torch.int64),
        "best_top1": torch.tensor(progress.best_top1, dtype=torch.float64),
        "lr": torch.tensor(scheduler.get_last_lr(), dtype=torch.float64),
        "rng": torch.get_rng_state(),
    }, osd["param_groups"]


def save_checkpoint(ckpt_dir: Path, model: nn.Module, optimizer, scheduler, progress: Any,
                    meta: CheckpointMeta, session: Session) -> None:
    """Sharded DCP save of the whole training state + consolidated last.safetensors (all ranks call)."""
    wait_pending(session)
    sync_buffers(model, session)
    state, _ = _state(model, optimizer, scheduler, progress)
    if session.is_main:
        shutil.rmtree(ckpt_dir / TMP, ignore_errors=True)  # left by a crash
    session.barrier()
    if session.async_checkpoint and session.active:
        if not hasattr(session, "ckpt_group"):
            # A separate gloo group: the background writer must not interleave its collectives
            # with the training thread's on the default group.
            session.ckpt_group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, checkpoint_id=str(ckpt_dir / TMP), process_group=session.ckpt_group)
        session.pending.append((future, ckpt_dir, meta.to_json()))
    else:
        dcp.save(state, checkpoint_id=str(ckpt_dir / TMP))
        _commit(ckpt_dir, meta.to_json(), session)
        session.barrier()
    save_weights(ckpt_dir / "last.safetensors", model, meta, session)


def wait_pending(session: Session) -> None:
    while session.pending:
        future, ckpt_dir, meta_json = session.pending.pop(0)
        getattr(future, "upload_completion", future).result()
        if session.active:
            dist.barrier(group=session.ckpt_group)  # every rank's shards are on disk
        _commit(ckpt_dir, meta_json, session)


def _commit(ckpt_dir: Path, meta_json: str, session: Session) -> None:
    if not session.is_main:
        return
    tmp, last, old = ckpt_dir / TMP, ckpt_dir / LAST, ckpt_dir / OLD
    (tmp / META).write_text(meta_json)
    shutil.rmtree(old, ignore_errors=True)
    if last.exists():
        last.rename(old)
    tmp.rename(last)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(ckpt_dir: Path, model: nn.Module, optimizer, scheduler, meta: CheckpointMeta,
                    session: Session) -> tuple[tuple[int, int, int, float], torch.Tensor]:
    """Load last.dcp into this world size; returns ((epoch, step, step_in_epoch, best_top1), rng)."""
    path = ckpt_dir / LAST
    if not (path / ".metadata").is_file():
        raise UserError(f"{ckpt_dir} has no sharded checkpoint last.dcp/ to resume from with torchrun: it was "
                        "written by a single process (last.state.pt, unsharded optimizer state). Resume it with "
                        "--parallel none, or start the torchrun run afresh")
    check_same_model(path, meta)
    from torchcls.training.loop import Progress

    state, param_groups = _state(model, optimizer, scheduler, Progress())
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP reports a missing or mis-shaped tensor as a generic CheckpointException
        raise UserError(f"cannot load the sharded checkpoint {path} into this model: {str(e)[:300]}") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"], "param_groups": param_groups})
    lrs = state["lr"].tolist()
    sd = scheduler.state_dict()
    step = int(state["progress"][1])
    sd.update(last_epoch=step, _step_count=step + 1, _last_lr=lrs)
    scheduler.load_state_dict(sd)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    epoch, step, step_in_epoch = (int(v) for v in state["progress"])
    return (epoch, step, step_in_epoch, float(state["best_top1"])), state["rng"]


def check_same_model(path: Path, meta: CheckpointMeta) -> None:
    saved = CheckpointMeta.from_json((path / META).read_text())
    if asdict(saved.spec) != asdict(meta.spec) or saved.classes != meta.classes:
        raise UserError(f"checkpoint {path} is from another model ({saved.spec.name}, {saved.spec.num_classes} "
                        f"classes, {saved.spec.in_chans} channels) than this run ({meta.spec.name}, "
                        f"{meta.spec.num_classes} classes, {meta.spec.in_chans} channels): check --name/--model")


def consolidate(source: str | Path, out: str | Path | None = None) -> Path:
    """One process, no process group: load a DCP checkpoint (any world size it was written with)
    into the model its meta.json describes and write a single safetensors file."""
    from torchcls.models import create_model

    source = Path(source)
    path = source / "checkpoints" / LAST if (source / "checkpoints" / LAST).is_dir() else source
    if not (path / ".metadata").is_file() or not (path / META).is_file():
        raise UserError(f"{source} is neither a run dir with checkpoints/{LAST}/ nor a torchcls DCP checkpoint")
    meta = CheckpointMeta.from_json((path / META).read_text())
    model = create_model(meta.spec)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    out = Path(out) if out else path.parent / "consolidated.safetensors"
    save_weights(out, model, meta, Session())
    return out

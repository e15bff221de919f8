"""The sharded format: the whole training state of a torchrun run, with no pickle in it.

last.dcp/ holds one safetensors file per rank (tensors: weights, optimizer moments, the EMA, RNG;
where each shard sits in its tensor is in the file's header), written by DCP's pickle-free
HuggingFaceStorageWriter (checkpoint/hf_dcp.py); state.json, the rest of the state as plain numbers
(checkpoint/sharded_state.py); meta.json, the model spec and progress. Loading reshards to any
world size (2 -> 1, 1 -> 2, DDP <-> FSDP2): DCP addresses tensors by name and global offsets, not
by rank. Every save goes to a temporary dir that rank 0 renames into place once all ranks finished:
a crash mid-save keeps the old one.

The commit is two renames (last.dcp -> .last.dcp.old, .last.dcp.tmp -> last.dcp). A crash between
them leaves no last.dcp at all; `recover` finishes the commit instead (the temporary dir holds
meta.json only once every rank's write finished, so it is the newer complete checkpoint), or puts
.last.dcp.old back when there is nothing newer. Nothing is deleted to get out of that window.

A checkpoint written before (torch's FileSystemWriter: `.metadata`, a pickle, and `.distcp` files)
is recognised and refused, naming the way out: reading it means unpickling, which only happens under
--unsafe-unpickle (train --resume, consolidate), through a restricted unpickler (checkpoint/legacy_dcp.py).

Which directory is the run's (`last.dcp`) and when to save is the Checkpointer's business;
these functions take the directory.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchcls.checkpoint import hf_dcp, legacy_dcp, sharded_state
from torchcls.checkpoint.files import CheckpointMeta, atomic_write, model_state, plain_state, read_meta_json
from torchcls.checkpoint.sharded_state import PLATEAU_KEYS, STATE
from torchcls.errors import UserError

META = "meta.json"
LEGACY_METADATA = ".metadata"  # torch's FileSystemWriter index: a pickle
UNSAFE_FLAG = "--unsafe-unpickle"  # the option that reads pickles (config: checkpoint.unsafe_unpickle)


class Ranks(Protocol):
    """What checkpointing needs of the process group (torchcls.training.distributed.Session)."""

    active: bool
    rank: int
    world: int

    @property
    def is_main(self) -> bool: ...

    def barrier(self) -> None: ...


def is_legacy(path: Path) -> bool:
    """A checkpoint in torch's pickle format (`.metadata`), written before this format."""
    return os.path.lexists(path / LEGACY_METADATA) and not os.path.lexists(path / STATE)


def is_complete(path: Path) -> bool:
    """Does `path` hold a sharded checkpoint's data (either format)? meta.json: see `_finished`."""
    return os.path.lexists(path / STATE) or is_legacy(path)


def refuse_legacy(path: Path) -> None:
    """A checkpoint in torch's pickle format is refused unless the user opted in, before it is opened."""
    if is_legacy(path):
        run = path.parent.parent if path.parent.name == "checkpoints" else path
        raise UserError(f"{path} is a sharded checkpoint in torch's older pickle format ({LEGACY_METADATA}, written "
                        f"before torchcls saved them pickle-free): reading it means unpickling that file. If you trust "
                        f"where it came from, resume with {UNSAFE_FLAG} (its next checkpoint is written pickle-free), "
                        f"or consolidate it: `torchcls consolidate {UNSAFE_FLAG} {run}`. Nothing was read from it")


def read_meta(path: Path) -> CheckpointMeta:
    """meta.json of the checkpoint dir `path`, every field bounded (checkpoint/meta_check.py)."""
    return read_meta_json(path / META)


def saved_step(path: Path) -> int | None:
    """The optimizer step a complete DCP checkpoint was saved at (None: there is none)."""
    return read_meta(path).step if os.path.lexists(path / META) and is_complete(path) else None


def full_model_state(model: nn.Module, ranks: Ranks) -> dict[str, torch.Tensor] | None:
    """All ranks call this (FSDP2 gathers shards); rank 0 gets the full CPU state dict."""
    if not ranks.active:
        return model_state(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return plain_state(sd) if ranks.is_main else None


def training_state(model: nn.Module, optimizer, scheduler, progress: Any,
                   extras: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any], list]:
    """(the tensors for the shards, the rest for state.json, the optimizer's param groups, which are
    rebuilt from this run's optimizer, not saved: a resume may change a hyperparameter).
    `extras`: further stateful parts of the run (the weights' EMA), saved under their names."""
    osd = get_optimizer_state_dict(model, optimizer)  # creates zero moments on a fresh optimizer
    tree = {"model": get_model_state_dict(model), "optim": {"state": osd["state"]}, "rng": torch.get_rng_state()}
    if extras:
        tree["extras"] = {k: v.state_dict() for k, v in extras.items()}
    tensors, other = sharded_state.split(tree)
    tensors = hf_dcp.storable(tensors)  # FP8 all-gather weights: the fp32 tensors they wrap
    rest = {"epoch": progress.epoch, "step": progress.step, "step_in_epoch": progress.step_in_epoch,
            "best_top1": float(progress.best_top1), "lr": [float(lr) for lr in scheduler.get_last_lr()],
            "other": other}
    if getattr(progress, "epoch_sums", None) is not None:
        rest["epoch_sums"] = _every_ranks_row(progress.epoch_sums)
    plateau = scheduler.state_dict().get("plateau")
    if plateau:  # --sched plateau: where its patience count stands, not only the rates it reduced
        rest["plateau"] = {k: float(plateau[k]) if k == "best" else int(plateau[k]) for k in PLATEAU_KEYS}
    return tensors, rest, osd["param_groups"]


def _every_ranks_row(row: tuple[float, ...]) -> list[list[float]]:
    """Each rank's row (its epoch sums), gathered: rank 0 writes state.json for all of them."""
    mine = torch.tensor([row], dtype=torch.float64)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine.tolist()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.cat(rows).tolist()


def _my_row(saved: list[list[float]]) -> tuple[float, ...]:
    """This rank's epoch sums from the saved rows. Resumed on another world size, rank 0 takes the
    figures of every saved rank (the sums add up; the seconds are the longest rank's), the others none."""
    rows = torch.tensor(saved, dtype=torch.float64)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if len(rows) == world:
        return tuple(rows[rank].tolist())
    if rank:
        return (0.0,) * rows.shape[1]
    total = rows.sum(0)
    total[-1] = rows[:, -1].max()
    return tuple(total.tolist())


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def _finished(path: Path) -> bool:
    """A checkpoint dir every rank finished writing: commit puts meta.json into it only after that."""
    return is_complete(path) and (path / META).is_file()


def start_save(path: Path, tensors: dict[str, Any], ranks: Ranks, group=None):
    """Write the shards of `tensors` into the temporary dir beside `path` (all ranks call). With a
    process `group`, in a background thread: returns its future (then `commit` after it completed); else None."""
    hf_dcp.check_tensors_only(tensors)
    if ranks.is_main:
        recover(path)  # a finished write of a crashed commit is kept, not overwritten
        if _tmp(path).is_symlink():  # (rmtree refuses a link, and DCP's writer would write through it)
            _tmp(path).unlink()
        shutil.rmtree(_tmp(path), ignore_errors=True)  # what is left is a write a crash cut short
    ranks.barrier()
    writer = hf_dcp.writer(_tmp(path))
    if group is not None:
        return dcp.async_save(tensors, storage_writer=writer, process_group=group)
    dcp.save(tensors, storage_writer=writer)
    return None


def commit(path: Path, meta_json: str, state_json: str, ranks: Ranks) -> None:
    """Rank 0 puts the finished temporary dir in place of `path` (every rank's shards are on disk)."""
    if not ranks.is_main:
        return
    atomic_write(_tmp(path) / STATE, lambda f: Path(f).write_text(state_json))
    atomic_write(_tmp(path) / META, lambda f: Path(f).write_text(meta_json))  # marks the write finished
    _swap(path)


def _swap(path: Path) -> None:
    """The commit's renames, from wherever a crash interrupted them: each step can be done again."""
    tmp, old = _tmp(path), _old(path)
    if path.exists():  # not there: a crash came between the two renames, and .old is the previous one
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def recover(path: Path) -> str | None:
    """Finish a commit that a crash interrupted (rank 0 or one process, before anyone looks for a
    checkpoint). Returns what was done, None when there was nothing to do."""
    tmp, old = _tmp(path), _old(path)
    if _finished(tmp):
        _swap(path)
        return f"finished the commit a crash interrupted: {tmp.name} (step {saved_step(path)}) is now {path.name}"
    if not path.exists() and _finished(old):
        old.rename(path)
        return f"restored {path.name} (step {saved_step(path)}) from {old.name}: a crash came during its commit"
    return None


def load(path: Path, model: nn.Module, optimizer, scheduler, progress: Any, meta: CheckpointMeta,
         extras: dict[str, Any] | None = None, unsafe_unpickle: bool = False,
         ) -> tuple[tuple[int, int, int, float, tuple | None], torch.Tensor]:
    """Load `path` into this world size; returns ((epoch, step, step_in_epoch, best_top1, epoch_sums), rng).
    `progress`: an empty progress record of the trainer (the shape of what is loaded). `unsafe_unpickle`:
    a checkpoint in torch's pickle format is read (through safe_dcp's restricted unpickler), else refused."""
    check_same_model(path, meta)
    tensors, rest, param_groups = training_state(model, optimizer, scheduler, progress, extras)
    if is_legacy(path):
        if not unsafe_unpickle:
            refuse_legacy(path)
        saved = legacy_dcp.load_training_state(path, tensors, rest)
    else:
        saved = sharded_state.read(path)
        if len(saved["lr"]) != len(optimizer.param_groups):
            raise UserError(f"{path / STATE}: {len(saved['lr'])} learning rates for this run's {len(optimizer.param_groups)}"
                            " parameter groups: the checkpoint is from another optimizer setup")
        saved["other"] = sharded_state.restore(rest["other"], saved["other"], f"{path / STATE}: other")
        hf_dcp.load(tensors, path)
    state = sharded_state.merge(tensors, saved["other"])
    set_model_state_dict(model, state["model"])
    for name, part in (extras or {}).items():
        part.load_state_dict(state["extras"][name])
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"], "param_groups": param_groups})
    _restore_schedule(scheduler, optimizer, saved)
    sums = _my_row(saved["epoch_sums"]) if "epoch_sums" in saved else None
    return (saved["epoch"], saved["step"], saved["step_in_epoch"], saved["best_top1"], sums), state["rng"]


def _restore_schedule(scheduler, optimizer, saved: dict[str, Any]) -> None:
    lrs, step = saved["lr"], saved["step"]
    sd = scheduler.state_dict()
    sd.update(last_epoch=step, _step_count=step + 1, _last_lr=lrs)
    if sd.get("plateau") and "plateau" in saved:  # absent: written by another --sched; its patience starts again
        sd["plateau"].update(saved["plateau"])
    scheduler.load_state_dict(sd)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def check_same_model(path: Path, meta: CheckpointMeta) -> None:
    saved = read_meta(path)
    if asdict(saved.spec) != asdict(meta.spec) or saved.classes != meta.classes:
        raise UserError(f"checkpoint {path} is from another model ({saved.spec.name}, {saved.spec.num_classes} "
                        f"classes, {saved.spec.in_chans} channels) than this run ({meta.spec.name}, "
                        f"{meta.spec.num_classes} classes, {meta.spec.in_chans} channels): check --name/--model")


def new_group():
    # A separate gloo group for background saves: the writer thread must not interleave its
    # collectives with the training thread's on the default group.
    return dist.new_group(backend="gloo")


def group_barrier(group) -> None:
    dist.barrier(group=group)

"""The sharded format: the whole training state with torch.distributed.checkpoint (DCP).

Each rank writes its own shards (.distcp) plus the shared .metadata; meta.json beside them
holds the model spec and progress. Loading reshards to any world size (2 -> 1, 1 -> 2,
DDP <-> FSDP2): DCP addresses tensors by name and global offsets, not by rank.
The state holds tensors only (weights, optimizer moments, progress counters, learning rates,
RNG): no pickled objects are written or loaded. Every save goes to a temporary dir that rank 0
renames into place once all ranks finished: a crash mid-save keeps the old one.

The commit is two renames (last.dcp -> .last.dcp.old, .last.dcp.tmp -> last.dcp). A crash between
them leaves no last.dcp at all; `recover` finishes the commit instead (the temporary dir holds
meta.json only once every rank's write finished, so it is the newer complete checkpoint), or puts
.last.dcp.old back when there is nothing newer. Nothing is deleted to get out of that window.

Which directory is the run's (`last.dcp`) and when to save is the Checkpointer's business;
these functions take the directory.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchcls.checkpoint.files import (
    CHECKPOINTS,
    LAST_DCP,
    CheckpointMeta,
    atomic_write,
    model_state,
    plain_state,
    write_weights,
)
from torchcls.checkpoint.safe_dcp import SafeReader, safe_load
from torchcls.errors import UserError

META = "meta.json"


class Ranks(Protocol):
    """What checkpointing needs of the process group (torchcls.training.distributed.Session)."""

    active: bool
    rank: int
    world: int

    @property
    def is_main(self) -> bool: ...

    def barrier(self) -> None: ...


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def saved_step(path: Path) -> int | None:
    """The optimizer step a complete DCP checkpoint was saved at (None: there is none)."""
    meta = path / META
    return json.loads(meta.read_text())["step"] if meta.is_file() and is_complete(path) else None


def full_model_state(model: nn.Module, ranks: Ranks) -> dict[str, torch.Tensor] | None:
    """All ranks call this (FSDP2 gathers shards); rank 0 gets the full CPU state dict."""
    if not ranks.active:
        return model_state(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return plain_state(sd) if ranks.is_main else None


# ReduceLROnPlateau's counters, kept in the DCP state as one float64 tensor (DCP holds tensors, not dicts).
PLATEAU_KEYS = ("best", "num_bad_epochs", "cooldown_counter", "last_epoch")


def training_state(model: nn.Module, optimizer, scheduler, progress: Any,
                   extras: dict[str, Any] | None = None) -> tuple[dict[str, Any], list]:
    """The DCP state dict (tensors only) and the optimizer's param groups, which are rebuilt, not saved.
    `extras`: further stateful parts of the run (the weights' EMA), saved under their names."""
    osd = get_optimizer_state_dict(model, optimizer)  # creates zero moments on a fresh optimizer
    more = {"extras": {k: v.state_dict() for k, v in extras.items()}} if extras else {}
    if getattr(progress, "epoch_sums", None) is not None:
        more["epoch_sums"] = _every_ranks_row(progress.epoch_sums)
    plateau = scheduler.state_dict().get("plateau")
    if plateau:  # --sched plateau: where its patience count stands, not only the rates it reduced
        more["plateau"] = torch.tensor([plateau[k] for k in PLATEAU_KEYS], dtype=torch.float64)
    return more | {
        "model": get_model_state_dict(model),
        "optim": {"state": osd["state"]},
        "progress": torch.tensor([progress.epoch, progress.step, progress.step_in_epoch], dtype=torch.int64),
        "best_top1": torch.tensor(progress.best_top1, dtype=torch.float64),
        "lr": torch.tensor(scheduler.get_last_lr(), dtype=torch.float64),
        "rng": torch.get_rng_state(),
    }, osd["param_groups"]


def _every_ranks_row(row: tuple[float, ...]) -> torch.Tensor:
    """[world, len(row)]: each rank's row (its epoch sums). DCP writes one copy of a plain tensor that
    every rank holds, so rows that differ between ranks are gathered into one that every rank holds."""
    mine = torch.tensor([row], dtype=torch.float64)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.cat(rows)


def _my_row(rows: torch.Tensor) -> tuple[float, ...]:
    """This rank's epoch sums from the saved rows. Resumed on another world size, rank 0 takes the
    figures of every saved rank (the sums add up; the seconds are the longest rank's), the others none."""
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


def start_save(path: Path, state: dict[str, Any], ranks: Ranks, group=None):
    """Write `state` into the temporary dir beside `path` (all ranks call). With a process `group`,
    in a background thread: returns its future (then `commit` after it completed); else None."""
    if ranks.is_main:
        recover(path)  # a finished write of a crashed commit is kept, not overwritten
        shutil.rmtree(_tmp(path), ignore_errors=True)  # what is left is a write a crash cut short
    ranks.barrier()
    if group is not None:
        return dcp.async_save(state, checkpoint_id=str(_tmp(path)), process_group=group)
    dcp.save(state, checkpoint_id=str(_tmp(path)))
    return None


def commit(path: Path, meta_json: str, ranks: Ranks) -> None:
    """Rank 0 puts the finished temporary dir in place of `path` (every rank's shards are on disk)."""
    if not ranks.is_main:
        return
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
         extras: dict[str, Any] | None = None) -> tuple[tuple[int, int, int, float, tuple | None], torch.Tensor]:
    """Load `path` into this world size; returns ((epoch, step, step_in_epoch, best_top1, epoch_sums), rng).
    `progress`: an empty progress record of the trainer (the shape of what is loaded)."""
    check_same_model(path, meta)
    state, param_groups = training_state(model, optimizer, scheduler, progress, extras)
    saved = SafeReader(str(path)).read_metadata().state_dict_metadata
    if "plateau" in state and "plateau" not in saved:
        del state["plateau"]  # written before the counters were saved: the plateau's patience starts again
    if "epoch_sums" in saved:  # as many rows as the saving world had ranks
        state["epoch_sums"] = torch.zeros(tuple(saved["epoch_sums"].size), dtype=torch.float64)
    try:
        safe_load(state, path)
    except UserError:
        raise
    except (Exception, CheckpointException) as e:  # a missing or mis-shaped tensor: a generic CheckpointException
        raise UserError(f"cannot load the sharded checkpoint {path} into this model: {str(e)[:300]}") from None
    set_model_state_dict(model, state["model"])
    for name, part in (extras or {}).items():
        part.load_state_dict(state["extras"][name])
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"], "param_groups": param_groups})
    lrs = state["lr"].tolist()
    sd = scheduler.state_dict()
    step = int(state["progress"][1])
    sd.update(last_epoch=step, _step_count=step + 1, _last_lr=lrs)
    if "plateau" in state:
        sd["plateau"].update({k: int(v) if k != "best" else v for k, v in zip(PLATEAU_KEYS, state["plateau"].tolist())})
    scheduler.load_state_dict(sd)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    epoch, step, step_in_epoch = (int(v) for v in state["progress"])
    sums = _my_row(state["epoch_sums"]) if "epoch_sums" in state else None
    return (epoch, step, step_in_epoch, float(state["best_top1"]), sums), state["rng"]


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
    path = source / CHECKPOINTS / LAST_DCP if (source / CHECKPOINTS / LAST_DCP).is_dir() else source
    if not is_complete(path) or not (path / META).is_file():
        raise UserError(f"{source} is neither a run dir with {CHECKPOINTS}/{LAST_DCP}/ nor a torchcls DCP checkpoint")
    meta = CheckpointMeta.from_json((path / META).read_text())
    model = create_model(meta.spec)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        safe_load(state, path)
    model.load_state_dict(state["model"])
    out = Path(out) if out else path.parent / "consolidated.safetensors"
    write_weights(out, model_state(model), meta)
    return out


def new_group():
    # A separate gloo group for background saves: the writer thread must not interleave its
    # collectives with the training thread's on the default group.
    return dist.new_group(backend="gloo")


def group_barrier(group) -> None:
    dist.barrier(group=group)

"""The Checkpointer: what a run saves, where, and how it resumes.

runs/<name>/checkpoints/ holds
  last.safetensors   the latest weights (one file, whatever the world size) with their metadata,
  best.safetensors   the weights of the best validation top-1,
  last.state.safetensors  one process: weights, optimizer, scheduler, progress, RNG, grad scaler, extras
                     (tensors, and the rest as JSON in its metadata; an older run's last.state.pt, a pickle,
                     is read only with --unsafe-unpickle),
  last.dcp/          torchrun: the sharded training state (weights included), see checkpoint/dcp.py.
evaluate / predict / export / serve read only the .safetensors files. Every .safetensors file
carries the run's lineage (governance) in its metadata from the moment it is written.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.checkpoint import dcp, sharded_state
from torchcls.checkpoint.files import (
    BEST,
    LAST,
    LAST_DCP,
    LAST_STATE,
    LEGACY_STATE,
    CheckpointMeta,
    load_training_state,
    load_weights_into,
    model_state,
    read_meta,
    save_training_state,
    write_weights,
)
from torchcls.checkpoint.state_file import RESUME_HINT, check_state, read_step
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.io_errors import writing


@dataclass
class Progress:
    """Where training stands: what a checkpoint records and a resume restores."""
    epoch: int = 0
    step: int = 0  # optimizer steps since the start of the run
    step_in_epoch: int = 0
    best_top1: float = -1.0
    # This rank's running sums of the epoch so far (loss x images, correct, images, seconds): a run
    # resumed mid-epoch logs the whole epoch's figures, not only those of the steps after its checkpoint.
    # None: not recorded (a checkpoint written before they were).
    epoch_sums: tuple[float, float, float, float] | None = None


@dataclass
class SingleProcess:
    """The Ranks of a run without a process group."""
    active: bool = False
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return True

    def barrier(self) -> None:
        pass


class Checkpointer:
    """Saves and resumes one run's checkpoints. With an active process group (ranks), every rank
    calls save / resume (the sharded format); without one, the single-process format."""

    def __init__(self, directory: Path, ranks: dcp.Ranks | None = None, *, async_save: bool = False,
                 lineage: dict[str, Any] | None = None, before_save: Callable[[nn.Module], None] | None = None,
                 extras: dict[str, Any] | None = None, unsafe_unpickle: bool = False):
        self.directory = Path(directory)
        self.unsafe_unpickle = unsafe_unpickle  # read an older run's pickled state (--unsafe-unpickle)
        self.ranks = ranks or SingleProcess()
        self.async_save = async_save and self.ranks.active  # background writes exist for DCP only
        self.lineage = lineage  # stamped into every .safetensors written
        self.before_save = before_save  # e.g. make every rank's BatchNorm statistics the same
        self.extras = extras or {}  # more stateful parts of the run (state_dict/load_state_dict), e.g. the EMA
        self._group = None
        self._pending: list[tuple[Any, str]] = []  # background saves not yet committed
        # The files this process wrote: what the run's audit record lists (a resumed run dir may hold others)
        self.written: set[Path] = set()

    last_weights = property(lambda self: self.directory / LAST)
    best_weights = property(lambda self: self.directory / BEST)
    last_state = property(lambda self: self.directory / LAST_STATE)
    legacy_state = property(lambda self: self.directory / LEGACY_STATE)
    last_dcp = property(lambda self: self.directory / LAST_DCP)

    # -- what is there ----------------------------------------------------------------------
    def has_state(self) -> bool:
        """Is there a training state to resume from (either format)?"""
        return self._state_file() is not None or dcp.is_complete(self.last_dcp)

    def _state_file(self) -> Path | None:
        """The single-process state to resume from: the safetensors one, else an older run's pickle (which
        the first checkpoint of the resumed run supersedes), else None."""
        return next((p for p in (self.last_state, self.legacy_state) if p.is_file()), None)

    def recover(self) -> str | None:
        """Finish a sharded checkpoint's commit that a crash interrupted, before anything asks has_state
        (rank 0 or one process only: it renames). Returns what it did, None when nothing was needed."""
        done = dcp.recover(self.last_dcp) if self.directory.is_dir() else None
        if done:
            console.print(f"[yellow]{self.directory}: {done}[/]")
        return done

    def saved_step(self) -> int | None:
        """The optimizer step of the state a resume would load (None: there is none). Reads only what
        a commit writes last (meta.json; the state file's header), so a torn write shows as absent."""
        step = dcp.saved_step(self.last_dcp)
        state_step = None if self.ranks.active else self._single_step()
        if state_step is None:
            return step
        return max(state_step, step if step is not None else -1)

    def _single_step(self) -> int | None:
        state = self._state_file()
        if state is None:
            return None
        if state == self.last_state:
            return read_step(state)
        # An older run's pickle is not opened to ask: its last.safetensors was written with it, of its step.
        try:
            return read_meta(self.last_weights).step
        except UserError:
            return None

    def resumes_from_dcp(self) -> bool:
        """Ranks always resume from DCP; a single process does when its DCP state is the newer one."""
        if self.ranks.active:
            return True
        step = dcp.saved_step(self.last_dcp)
        if step is None:
            return False
        single = self._single_step()
        return single is None or step > single

    # -- save -------------------------------------------------------------------------------
    def save(self, model: nn.Module, optimizer, scheduler, progress: Progress, meta: CheckpointMeta,
             precision=None) -> None:
        """The whole training state and last.safetensors. `precision`: its state_dict() is saved too
        (the fp16 grad scaler; single-process format)."""
        if self.ranks.active:
            return self._save_sharded(model, optimizer, scheduler, progress, meta)
        self.save_weights(self.last_weights, model, meta)
        self.written.add(self.last_state)
        # The state file carries the weights too: one atomic file is one commit, so a kill between
        # this write and last.safetensors' can never resume new weights with old optimizer state.
        save_training_state(self.last_state, {
            "model": model_state(model), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "epoch": progress.epoch, "step": progress.step, "step_in_epoch": progress.step_in_epoch,
            "best_top1": progress.best_top1, "rng": torch.get_rng_state(),
            "precision": precision.state_dict() if precision is not None else {},
            "extras": {k: v.state_dict() for k, v in self.extras.items()},
        } | ({"epoch_sums": torch.tensor(progress.epoch_sums, dtype=torch.float64)}
             if progress.epoch_sums is not None else {}))

    def _save_sharded(self, model: nn.Module, optimizer, scheduler, progress: Progress,
                      meta: CheckpointMeta) -> None:
        self.wait()
        if self.before_save is not None:
            self.before_save(model)
        tensors, rest, _ = dcp.training_state(model, optimizer, scheduler, progress, self.extras)
        state_json = sharded_state.dumps(rest)  # now: a background write commits what this step had
        if self.async_save and self._group is None:
            self._group = dcp.new_group()
        with writing(self.last_dcp):  # a failed write leaves the committed last.dcp as it was
            future = dcp.start_save(self.last_dcp, tensors, self.ranks, self._group if self.async_save else None)
            if future is None:
                dcp.commit(self.last_dcp, meta.to_json(), state_json, self.ranks)
        if future is not None:
            self._pending.append((future, meta.to_json(), state_json))
        else:
            self.ranks.barrier()
        self.save_weights(self.last_weights, model, meta)

    def save_weights(self, path: Path, model: nn.Module, meta: CheckpointMeta) -> None:
        """One consolidated safetensors file (all ranks call: FSDP2 gathers; rank 0 writes)."""
        state = dcp.full_model_state(model, self.ranks)
        if self.ranks.is_main:
            write_weights(path, state, meta, self.lineage)
            self.written.add(path)

    def save_best(self, model: nn.Module, meta: CheckpointMeta) -> None:
        self.save_weights(self.best_weights, model, meta)

    def wait(self) -> None:
        """Finish the background saves: commit each once every rank's shards are on disk."""
        while self._pending:
            future, meta_json, state_json = self._pending.pop(0)
            with writing(self.last_dcp):
                getattr(future, "upload_completion", future).result()
            dcp.group_barrier(self._group)
            with writing(self.last_dcp):
                dcp.commit(self.last_dcp, meta_json, state_json, self.ranks)

    # -- resume -----------------------------------------------------------------------------
    def resume(self, model: nn.Module, optimizer, scheduler, meta: CheckpointMeta,
               precision=None) -> tuple[Progress, torch.Tensor | None]:
        """Load the last training state into these objects. Returns the progress and, when the
        checkpoint was taken mid-epoch, the RNG state to restore once the epoch is replayed."""
        if self.resumes_from_dcp():
            if not dcp.is_complete(self.last_dcp):
                raise UserError(f"{self.directory} has no sharded checkpoint {LAST_DCP}/ to resume from with "
                                f"torchrun: it was written by a single process ({LAST_STATE}, unsharded optimizer "
                                "state). Resume it with --parallel none, or start the torchrun run afresh")
            fields, rng = dcp.load(self.last_dcp, model, optimizer, scheduler, Progress(), meta, self.extras,
                                   unsafe_unpickle=self.unsafe_unpickle)
            progress = Progress(*fields)
        else:
            path = self._state_file() or self.last_state
            state = check_state(load_training_state(path, self.unsafe_unpickle), path)
            self._check_parts(state, path, optimizer, scheduler, precision)  # all of it, before anything is set
            if "model" in state:
                load_weights_into(model, path, state["model"])
            else:  # written before the state carried the weights: the pair must be of one step
                _check_same_step(self.last_weights, state["step"])
                load_weights_into(model, self.last_weights)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if precision is not None:
                precision.load_state_dict(state.get("precision", {}))
            for name, part in self.extras.items():
                part.load_state_dict(state["extras"][name])
            sums = state.get("epoch_sums")
            progress = Progress(**sharded_state.progress(state, str(path)),
                                epoch_sums=tuple(sums.tolist()) if sums is not None else None)
            rng = state["rng"]
        return progress, rng if progress.step_in_epoch else None

    def _check_parts(self, state: dict[str, Any], path: Path, optimizer, scheduler, precision) -> None:
        """The single-process state's parts (state_file.check_state typed its fixed fields) have the shape of this
        run's own: what each load_state_dict sets is then of the types the run itself sets, as the sharded format
        ensures by loading into this run's state (dcp.load)."""
        where = f"training state {path}"
        _check_optimizer(state["optimizer"], optimizer, f"{where}: optimizer", RESUME_HINT)
        sharded_state.like(state["scheduler"], scheduler.state_dict(), f"{where}: scheduler")
        sharded_state.number(state["scheduler"]["last_epoch"], "scheduler.last_epoch", where, 0,
                             sharded_state.MAX_COUNTER, integer=True)
        # a part one of the two runs has not (fp16's scaler) is not loaded
        _check_shared_keys(state.get("precision", {}), precision.state_dict() if precision is not None else {},
                           f"{where}: precision")
        if self.extras:
            sharded_state.like(state.get("extras"), {k: v.state_dict() for k, v in self.extras.items()},
                               f"{where}: extras")


def _check_optimizer(saved: dict[str, Any], optimizer, where: str, hint: str) -> None:
    """An optimizer state torch's load_state_dict can take for `optimizer`: its groups like this run's, and the
    state of each parameter a step count and moments of its shape. (This run's own state cannot be compared: a
    fresh optimizer has none until its first step.)"""
    expected = optimizer.state_dict()
    if set(saved) != set(expected) or type(saved["state"]) is not dict:
        raise UserError(f"{where}: must hold {' and '.join(expected)} as torch writes them: damaged or crafted; "
                        f"{hint}")
    _check_groups(saved["param_groups"], expected["param_groups"], where, hint)
    _check_param_states(saved, optimizer, where, hint)


def _check_groups(groups: Any, mine: list[dict[str, Any]], where: str, hint: str) -> None:
    """The saved param_groups, as many dicts as this run's `mine`, each like its own on the keys both have: a key
    one torch version adds to a group (and fills in when it loads an older state, as its optimizers' __setstate__
    do) must not make a run saved under the other unresumable. Under a key this run's group has not, a fresh
    optimizer's yet (lamb's "step", set by its first step) or another torch version's option: a step count or a
    plain value, which this optimizer does not read."""
    if type(groups) is not list or len(groups) != len(mine) or any(type(g) is not dict for g in groups):
        raise UserError(f"{where}: param_groups must be {len(mine)} dicts, as this run's: damaged or from another "
                        f"optimizer setup; {hint}")
    for i, (group, own) in enumerate(zip(groups, mine)):
        if not all(_step_count(v) or _plain(v) for k, v in group.items() if k not in own):
            raise UserError(f"{where}: param_groups[{i}] holds a value that is neither a step count nor a plain "
                            f"option under a key this run has not: damaged or crafted; {hint}")
        _check_shared_keys(group, own, f"{where}.param_groups[{i}]")


def _check_param_states(saved: dict[str, Any], optimizer, where: str, hint: str) -> None:
    """Each saved parameter state belongs to a parameter of the groups (saved ids paired with this run's
    parameters in order, as torch's Optimizer.load_state_dict pairs them) and holds a step count under "step" and
    a moment of its parameter's shape under any other name."""
    saved_ids = itertools.chain.from_iterable(g["params"] for g in saved["param_groups"])
    params = dict(zip(saved_ids, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)))
    for pid, entry in saved["state"].items():
        if pid not in params or type(entry) is not dict:
            raise UserError(f"{where}: state of {str(pid)[:40]}, which is no parameter of its groups: damaged or "
                            f"crafted; {hint}")
        for name, value in entry.items():
            if name == "step":
                ok, kind = _step_count(value), "a step count"
            else:
                ok, kind = _moment(value, params[pid]), "a tensor of its parameter shape"
            if not ok:
                raise UserError(f"{where}: state {pid}.{str(name)[:40]} is not {kind}: damaged or crafted; {hint}")


def _check_shared_keys(saved: dict[str, Any], mine: dict[str, Any], where: str) -> None:
    """`saved` like `mine` (sharded_state.like) on the keys both have; a key only one of them has is not compared."""
    shared = [k for k in saved if k in mine]
    sharded_state.like({k: saved[k] for k in shared}, {k: mine[k] for k in shared}, where)


def _step_count(value: Any) -> bool:
    """A step count, as every --optimizer and Lookahead keep under "step": a 0-d tensor, or a number torch
    converts, in [0, MAX_COUNTER]."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return False
        value = value.item()
    return type(value) in (int, float) and 0 <= value <= sharded_state.MAX_COUNTER


def _moment(value: Any, param: torch.Tensor) -> bool:
    """A moment of `param`, as every --optimizer and Lookahead keep beside the step: a float tensor of its shape.
    (A factored optimizer, Adafactor's rows and columns, would need its shapes here.)"""
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.is_floating_point()


def _plain(value: Any) -> bool:
    """A plain option value (None, a bool, a number or a string)."""
    return value is None or type(value) in (bool, int, float, str)


def _check_same_step(weights: Path, step: int) -> None:
    saved = read_meta(weights).step
    if saved != step:
        raise UserError(f"{weights} is from step {saved} but the training state beside it from step {step}: the "
                        "run was stopped between the two writes of a checkpoint. Resuming would pair weights and "
                        "optimizer state of different steps; start the run again (or from best.safetensors with "
                        "--pretrained)")

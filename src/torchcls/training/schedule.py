"""The learning-rate schedule, stepped after every optimizer step: a linear warm-up over
optim.warmup_epochs, then --sched.

cosine: timm's CosineLRScheduler to 0; linear: timm's PolyLRScheduler of power 1 to 0 (airbench's);
step: timm's MultiStepLRScheduler, x0.1 at 1/3 and 2/3 of the steps; onecycle: torch's OneCycleLR (its own
warm-up of warmup_epochs, cosine annealing to lr/25e4, the momentum of SGD-style optimizers cycled between
--momentum - 0.1 and --momentum);
plateau: the warm-up, then torch's ReduceLROnPlateau (x0.1 after PLATEAU_PATIENCE epochs without a
lower validation loss, fed by `epoch_end`). timm's own PlateauLRScheduler is deprecated and keeps
no state across a resume; ReduceLROnPlateau's state is saved with the schedule's.

Every group's rate is the schedule's value times group["lr_scale"] (layer decay, --head-lr): timm's
convention, which the torch schedulers get through per-group peaks. The interface is the one the
trainer and checkpoints use for torch schedulers: step(), get_last_lr(), state_dict() /
load_state_dict() with last_epoch (optimizer steps taken), base_lrs (resume_options rescales it for
a changed --lr).
"""

from __future__ import annotations

from typing import Any

import torch

from torchcls.config import OptimConfig

PLATEAU_PATIENCE = 2  # epochs
DECAY = 0.1  # step and plateau
ONECYCLE_DIV, ONECYCLE_FINAL_DIV = 25.0, 1e4  # torch's OneCycleLR defaults


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps_per_epoch: int,
                    epochs: int) -> LRSchedule:
    total = max(1, steps_per_epoch * epochs)
    return LRSchedule(optimizer, cfg.sched, int(cfg.warmup_epochs * steps_per_epoch), total, cfg.momentum)


class LRSchedule:
    def __init__(self, optimizer: torch.optim.Optimizer, sched: str, warmup_steps: int, total_steps: int,
                 momentum: float = 0.9):
        self.optimizer, self.sched = optimizer, sched
        self.warmup_steps, self.total_steps, self.momentum = warmup_steps, total_steps, momentum
        self.last_epoch = 0  # optimizer steps taken (torch's name: checkpoint code sets it)
        self._base = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.inner = self._inner()
        self.plateau = None
        if sched == "plateau":
            self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=DECAY,
                                                                      patience=PLATEAU_PATIENCE)
        self._apply()

    def _inner(self):
        from timm.scheduler import CosineLRScheduler, MultiStepLRScheduler, PolyLRScheduler

        w, total = self.warmup_steps, self.total_steps
        common = dict(warmup_t=w, warmup_lr_init=0.0, t_in_epochs=False)
        if self.sched in ("cosine", "linear") and total - w <= 1:
            # One step after the warm-up: the cosine's only value is the peak, a constant schedule gives the
            # same rate (and timm's cosine would log that it "will have no effect" on every 1-step run).
            return MultiStepLRScheduler(self.optimizer, decay_t=[], warmup_prefix=False, **common)
        if self.sched == "linear":  # airbench's: straight down to 0 (timm's polynomial decay of power 1)
            return PolyLRScheduler(self.optimizer, t_initial=max(1, total - w), power=1.0, lr_min=0.0,
                                   warmup_prefix=True, **common)
        if self.sched == "cosine":
            return CosineLRScheduler(self.optimizer, t_initial=max(1, total - w), lr_min=0.0, warmup_prefix=True,
                                     **common)
        if self.sched == "step":
            # timm applies milestone m at update m - 1: +1 puts the drops at 1/3 and 2/3 exactly.
            milestones = [round(total / 3) + 1, round(2 * total / 3) + 1]
            return MultiStepLRScheduler(self.optimizer, decay_t=milestones, decay_rate=DECAY, warmup_prefix=False,
                                        **common)
        if self.sched == "plateau":  # the warm-up, then constant: ReduceLROnPlateau takes over
            return MultiStepLRScheduler(self.optimizer, decay_t=[], warmup_prefix=False, **common)
        if self.sched == "onecycle":
            return self._onecycle()
        raise ValueError(f"unknown schedule {self.sched!r}")

    def _onecycle(self) -> torch.optim.lr_scheduler.OneCycleLR:
        groups = self.optimizer.param_groups
        cycle = "momentum" in self.optimizer.defaults and self.momentum > 0
        return torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=[b * g.get("lr_scale", 1.0) for b, g in zip(self._base, groups)],
            total_steps=max(2, self.total_steps), pct_start=min(0.99, max(1, self.warmup_steps) / self.total_steps),
            div_factor=ONECYCLE_DIV, final_div_factor=ONECYCLE_FINAL_DIV, cycle_momentum=cycle,
            base_momentum=max(0.0, self.momentum - 0.1), max_momentum=self.momentum)

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> None:
        """After each optimizer step."""
        self.last_epoch += 1
        self._apply()

    def _apply(self) -> None:
        """Set every group's rate for the next optimizer step, a function of last_epoch alone
        (plateau after warm-up: of the reductions so far, which live in the groups' rates)."""
        t = self.last_epoch
        if self.sched == "onecycle":
            self.inner.last_epoch = min(t, self.inner.total_steps - 1) - 1
            self.inner._step_count = max(self.inner._step_count, 2)  # not a first step(): no order warning
            self.inner.step()
        elif self.sched != "plateau" or t <= self.warmup_steps:
            # torchcls's warm-up gives step t the rate (t + 1) / W of the peak (the first step is not at 0)
            # and holds the peak for one step; timm's reaches it at W: its position is t + 1 during warm-up.
            self.inner.step_update(t + 1 if t < self.warmup_steps else t)

    def epoch_end(self, val_loss: float) -> None:
        """plateau: feed the epoch's validation loss (after warm-up); no-op for the other schedules."""
        if self.plateau is not None and self.last_epoch >= self.warmup_steps:
            self.plateau.step(val_loss)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # -- a changed --lr on resume (resume_options.apply_optim_changes) -------------------------
    @property
    def base_lrs(self) -> list[float]:
        """The peak rate of each group before its lr_scale."""
        return list(self._base)

    @base_lrs.setter
    def base_lrs(self, values: list[float]) -> None:
        # apply_optim_changes also scales each group's lr (the current step's) and initial_lr (OneCycleLR's start).
        self._set_base(values, initial=False)

    def _set_base(self, values: list[float], initial: bool = True) -> None:
        self._base = [float(v) for v in values]
        if self.sched == "onecycle":
            for b, g in zip(self._base, self.optimizer.param_groups):
                g["max_lr"] = b * g.get("lr_scale", 1.0)
                if initial:
                    g["initial_lr"] = g["max_lr"] / ONECYCLE_DIV
                g["min_lr"] = g["max_lr"] / ONECYCLE_DIV / ONECYCLE_FINAL_DIV
        else:
            self.inner.base_values = list(self._base)
            if self.warmup_steps:
                self.inner.warmup_steps = [b / self.warmup_steps for b in self._base]

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain values only (checkpoints are read with weights_only): the position, the bases, the plateau."""
        return {"last_epoch": self.last_epoch, "_step_count": self.last_epoch + 1, "_last_lr": self.get_last_lr(),
                "sched": self.sched, "base_lrs": self.base_lrs,
                "plateau": self.plateau.state_dict() if self.plateau is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        if state.get("base_lrs"):
            self._set_base(state["base_lrs"])
        if self.plateau is not None and state.get("plateau"):
            self.plateau.load_state_dict(state["plateau"])
        # The schedule's length comes from this run's config (a resume may add epochs), not from the state.
        self._apply()
        if self.sched == "plateau" and self.last_epoch > self.warmup_steps:
            for g, lr in zip(self.optimizer.param_groups, state["_last_lr"]):  # the reductions so far
                g["lr"] = lr

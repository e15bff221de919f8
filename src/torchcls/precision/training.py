"""Training precision, applied from outside the model: one function turns a `PrecisionConfig` into a
plan with an autocast context, a gradient scaler where one is needed (fp16), FP8 layers where they
pay, and a guard against NaN/Inf losses. Master weights stay fp32 in every mode.

Whether to torch.compile is the trainer's decision (torchcls.training); `fp8_wants_compile` says
what FP8 asks of it, and the plan's report records what the caller chose.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchcls.console import console
from torchcls.errors import UserError
from torchcls.precision.dtypes import DTYPES
from torchcls.precision.fp8 import Fp8Conversion, check_fsdp_all_gather, convert_fp8, fp8_hardware_note
from torchcls.precision.fp8_layers import summary
from torchcls.precision.hardware import PrecisionChoice, choose_precision, describe_device, require_bf16, require_fp16
from torchcls.run_files import write_text_atomic

if TYPE_CHECKING:
    from torchcls.config import PrecisionConfig

# The autocast dtype of each training precision (None: no autocast). fp8 runs the layers it does not
# convert (attention, norms, small linears) under bf16 autocast.
AUTOCAST = {"fp32": None, "bf16": DTYPES["bf16"], "fp16": DTYPES["fp16"], "fp8": DTYPES["bf16"]}
PRECISIONS = tuple(AUTOCAST)
FP8_COMPILE_NOTE = "enabled for FP8 as torchao recommends (--no-fp8-compile turns it off)"
MAX_SKIPPED_IN_A_ROW = 10  # past this, skipping cannot recover the run: stop instead of looping on NaN


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to `max_norm` in total; return the total norm before clipping as a plain tensor.
    Under FSDP2 the gradients are DTensor shards and torch returns their norm as a DTensor (a partial value
    on each rank); `full_tensor()` reduces it. A collective on that DTensor itself (the all-ranks skip flag of
    `_deferred_step`) has no sharding rule: FSDP2 with the deferred check failed on it (CPU and CUDA)."""
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class NonFiniteLoss(UserError):
    """The loss (or gradient norm) became NaN/Inf; the loop saves a checkpoint and re-raises."""


@dataclass
class PrecisionPlan:
    name: str
    device_type: str
    nonfinite: str = "stop"
    scaler: torch.amp.GradScaler | None = None
    fp8: Fp8Conversion | None = None
    compile: bool = False  # what the caller said it does (reported); the trainer decides, not the plan
    report: dict[str, Any] = field(default_factory=dict)
    log: Callable[[dict[str, Any]], None] = lambda record: None
    run_path: Path | None = None
    skipped_in_a_row: int = 0
    check_each_step: bool = True  # see `backward` and `defer_checks`
    _bad_loss: tuple[str, float] | None = None  # a non-finite loss among this step's micro-batches
    _finite: torch.Tensor | None = None  # deferred mode: were this step's losses finite (device bool)
    _counts: torch.Tensor | None = None  # deferred mode: the record of skipped steps, on the device

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        amp = torch.autocast(self.device_type, dtype=AUTOCAST[self.name])
        if self.fp8 is None or self.fp8.context is contextlib.nullcontext:
            return amp
        stack = contextlib.ExitStack()  # TransformerEngine: its FP8 context inside bf16 autocast
        stack.enter_context(amp)
        stack.enter_context(self.fp8.context())
        return stack

    def backward_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, model: nn.Module,
                      grad_clip: float, step: int) -> bool | torch.Tensor:
        """`backward` then `step`: one batch, one optimizer step."""
        self.backward(loss)
        return self.step(optimizer, model, grad_clip, step)

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """Backward of one (micro-)batch's loss; `scale` is 1 / the micro-batches of the step (--accum-steps).

        Checked each step (the default on the CPU, where reading a scalar costs no device round trip), a
        non-finite loss is not back-propagated: every rank learns it here and skips together. Deferred
        (`check_each_step = False`), its finiteness stays a device tensor that `step` turns into the
        optimizer's skip flag, and `check` reads at log steps."""
        if self.check_each_step:
            value = loss.item()
            if not _finite_everywhere(math.isfinite(value), loss.device):
                self._bad_loss = self._bad_loss or ("loss" if not math.isfinite(value) else "loss on another rank",
                                                    value)
            if self._bad_loss:
                return
        else:
            finite = torch.isfinite(loss.detach())
            self._finite = finite if self._finite is None else self._finite & finite
        loss = loss * scale if scale != 1.0 else loss
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, grad_clip: float,
             step: int) -> bool | torch.Tensor:
        """Clip and apply the gradients `backward` accumulated. Returns False when a NaN/Inf step was
        skipped (--nonfinite skip; raises NonFiniteLoss under --nonfinite stop), True when applied, and
        in deferred mode a device bool tensor saying which. Never applies a non-finite update."""
        if not self.check_each_step:
            return self._deferred_step(optimizer, model, grad_clip, step)
        if self._bad_loss:
            (what, value), self._bad_loss = self._bad_loss, None
            optimizer.zero_grad(set_to_none=True)
            return self._nonfinite(what, value, step)
        if grad_clip > 0:
            if self.scaler:
                self.scaler.unscale_(optimizer)
            norm = clip_gradients(model, grad_clip).item()
            if self.scaler is None and not math.isfinite(norm):  # with a scaler, inf grads are its business
                optimizer.zero_grad(set_to_none=True)
                return self._nonfinite("gradient norm", norm, step)
        if self.scaler:
            self.scaler.step(optimizer)  # skips the update itself when the scaled grads overflowed
            self.scaler.update()
        else:
            optimizer.step()
        if self.fp8 is not None:
            self.fp8.after_optimizer_step(model)
        self.skipped_in_a_row = 0
        return True

    def defer_checks(self, optimizer: torch.optim.Optimizer) -> bool:
        """Check for NaN/Inf on the device, without a host synchronisation per step, when the optimizer
        can skip an update from a device flag (torch's fused optimizers read `found_inf`, as GradScaler
        uses them) and no grad scaler is in play. Returns whether it does."""
        self.check_each_step = not (getattr(optimizer, "_step_supports_amp_scaling", False) and self.scaler is None)
        return not self.check_each_step

    def _deferred_step(self, optimizer, model: nn.Module, grad_clip: float, step: int) -> torch.Tensor:
        device = next(iter(model.parameters())).device
        ok = self._finite if self._finite is not None else torch.ones((), dtype=torch.bool, device=device)
        self._finite = None
        if grad_clip > 0:
            ok = ok & torch.isfinite(clip_gradients(model, grad_clip))
        if dist.is_available() and dist.is_initialized():  # all ranks skip together (queued, not waited for)
            flag = ok.to(torch.float32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = flag[0] > 0
        bad = (~ok).to(torch.float32)
        optimizer.grad_scale, optimizer.found_inf = None, bad
        try:
            optimizer.step()  # a fused kernel: no update, no step count, where found_inf is set
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        if self.fp8 is not None:
            self.fp8.after_optimizer_step(model)
        if self._counts is None:  # skipped steps, current run of them, longest run, last skipped step
            self._counts = torch.zeros(4, dtype=torch.float64, device=device)
        c, b = self._counts, bad.to(torch.float64)
        c[1] = (c[1] + b) * b
        c[0] += b
        c[2] = torch.maximum(c[2], c[1])
        c[3] = torch.where(b > 0, float(step), c[3])
        return ok

    def check(self) -> None:
        """Deferred mode: read the device's record of skipped steps (one synchronisation; the trainer calls
        this at log steps and epoch ends) and act on them as the per-step check would have."""
        if self._counts is None:
            return
        skipped, run, longest, last = self._counts.tolist()
        if not skipped:
            return
        self._counts.zero_()
        self._counts[1] = run  # a run of skipped steps continues across reads
        self.skipped_in_a_row = int(longest) - 1  # _nonfinite counts the last one itself
        self._nonfinite(f"loss or gradient norm ({int(skipped)} step(s) not applied)", float("nan"), int(last))

    def _nonfinite(self, what: str, value: float, step: int) -> bool:
        where = f"non-finite {what} ({value}) at step {step} under --precision {self.name}"
        saved = f" saved the last good state in {self.run_path / 'checkpoints'};" if self.run_path else ""
        other = "" if self.name == "fp32" else " try --precision fp32 (or bf16 rather than fp16/fp8),"
        fix = (f" lower --lr, keep --grad-clip on,{other} or pass --nonfinite skip to skip such steps; "
               "continue with --resume")
        if self.nonfinite == "stop":
            raise NonFiniteLoss(f"{where}: the run stopped (--nonfinite stop) and{saved}{fix}")
        self.skipped_in_a_row += 1
        self.log({"kind": "nonfinite", "step": step, "what": what, "value": str(value), "action": "skipped"})
        console.print(f"[yellow]{where}: step skipped (--nonfinite skip)[/]")
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise NonFiniteLoss(f"{where}: {self.skipped_in_a_row} steps in a row were non-finite, so skipping "
                                f"cannot recover this run; it stopped and{saved}{fix.replace(', or pass', ', or')}")
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def fp8_wants_compile(cfg: PrecisionConfig) -> bool:
    """torchao FP8 pays only when torch.compile fuses the scaling and casting around the FP8 GEMMs
    (not emulated, not TransformerEngine, and not turned off with --no-fp8-compile)."""
    return (cfg.precision == "fp8" and cfg.fp8_backend == "torchao" and not cfg.fp8_emulate
            and bool(cfg.fp8_compile))


def check_precision_options(cfg: PrecisionConfig, parallel: str) -> None:
    """The --precision options that are wrong whatever the data and hardware (train refuses them before any
    data is read). auto never resolves to fp8, so the FP8 flags need --precision fp8 itself."""
    if cfg.precision not in ("auto", *PRECISIONS):
        raise UserError(f"--precision {cfg.precision}: choose auto or one of {', '.join(PRECISIONS)}")
    if cfg.precision != "fp8" and cfg.fp8_emulate:
        raise UserError("--fp8-emulate applies only with --precision fp8; drop it or add --precision fp8")
    if cfg.fp8_table:
        if cfg.precision != "fp8" or cfg.fp8_min_dim:
            raise UserError(f"--fp8-table {cfg.fp8_table} chooses FP8 layers by measured GEMM speed-ups: it applies "
                            "only with --precision fp8 and without --fp8-min-dim (a size rule instead of the table)")
        from torchcls.precision.fp8_rule import MeasuredTable

        MeasuredTable.load(cfg.fp8_table)  # a missing or malformed table refused before any data is read
    check_fsdp_all_gather(cfg, parallel)


def apply_precision(model: nn.Module, cfg: PrecisionConfig, device: torch.device, run=None, *,
                    parallel: str = "none", compile: bool = False, compile_note: str = "",
                    example_shape: tuple[int, ...] | None = None, choice: PrecisionChoice | None = None,
                    ) -> PrecisionPlan:
    """Check the precision against the hardware, convert FP8 layers in place, and return the plan.

    Call before parallelize(): FP8 swaps nn.Linear modules, which FSDP must see already swapped.
    `parallel` is the parallel mode (none/ddp/fsdp2). `compile` and `compile_note` say whether and why the
    caller compiles the model (torchcls.training.compiled_forward.should_compile decides): reported, not decided here.
    `example_shape`: one training batch on this rank (N, C, H, W); FP8 measures each layer's tokens from it.
    `choice`: what --precision already resolved to (the training step's timing picked it), else the rule's.
    With `run` (a RunDir), the plan is printed, saved as precision.json and logs skipped steps."""
    check_precision_options(cfg, parallel)
    choice = choice or choose_precision(cfg.precision, device)  # auto: bf16 where the hardware has it, else fp32
    name = choice.precision
    if name == "fp16":
        require_fp16(device)
    if name in ("bf16", "fp8"):
        require_bf16(device)
    scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None  # fp16's narrow range needs loss scaling
    fp8 = convert_fp8(model, cfg, device, parallel, example_shape) if name == "fp8" else None
    plan = PrecisionPlan(name, device.type, cfg.nonfinite, scaler, fp8, compile)
    plan.report = _report(plan, cfg, device, compile_note, choice)
    if run is not None:
        plan.log, plan.run_path = run.log, run.path
        write_text_atomic(run.path / "precision.json", json.dumps(plan.report, indent=2))
        from torchcls.precision.summary import print_precision

        print_precision(plan.report)
    return plan


def _report(plan: PrecisionPlan, cfg: PrecisionConfig, device: torch.device, compile_note: str,
            choice: PrecisionChoice) -> dict[str, Any]:
    autocast = AUTOCAST[plan.name]
    report: dict[str, Any] = {
        "precision": plan.name, "requested": choice.requested, "reason": choice.reason, "warning": choice.warning,
        "device": describe_device(device),
        "autocast_dtype": None if autocast is None else str(autocast).removeprefix("torch."),
        "master_weights": "float32", "grad_scaler": plan.scaler is not None, "nonfinite": plan.nonfinite,
        "compile": plan.compile, "compile_note": compile_note if plan.compile else "", "fp8": None,
    }
    if plan.fp8 is not None:
        f = plan.fp8
        report["fp8"] = {
            "backend": f.backend, "recipe": f.recipe, "backend_recipe": f.backend_recipe, "emulate": f.emulate,
            "hardware": fp8_hardware_note(device, f.emulate), "min_dim": cfg.fp8_min_dim,
            "fsdp_float8_all_gather": f.fsdp_all_gather,
            "size_rule": f.rule, "table": cfg.fp8_table,
            **summary(f.layers), "layers": [d.to_dict() for d in f.layers],
        }
    return report


def _finite_everywhere(finite_here: bool, device: torch.device) -> bool:
    """Under torchrun, whether the loss was finite on every rank: all ranks skip (or stop) together.
    A rank that skipped alone would leave the others waiting in the gradient all-reduce until the
    process group timed out."""
    if not (dist.is_available() and dist.is_initialized()):
        return finite_here
    flag = torch.tensor([1.0 if finite_here else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())

"""FP8 training: swap the eligible nn.Linear layers for FP8 ones, via torchao or TransformerEngine.

torchao (`convert_to_float8_training`) is the default: its Float8Linear keeps fp32 master
weights, casts inputs/weights/grads to float8 with dynamic scales (tensorwise or rowwise),
and is fastest under torch.compile. TransformerEngine is an optional backend, imported only
when asked for; it is not a dependency and needs a CUDA build and an FP8 GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchcls.console import console
from torchcls.errors import UserError
from torchcls.precision.fp8_layers import LayerDecision, eligibility, linear_tokens
from torchcls.precision.fp8_rule import MeasuredTable, ShapeRule
from torchcls.precision.hardware import describe_device, has_fp8_hardware, require_fp8_hardware, require_torchao

if TYPE_CHECKING:
    from torchcls.config import PrecisionConfig

TE_INSTALL = ("pip install 'transformer-engine[pytorch]' on a machine with a CUDA toolkit and an FP8 GPU "
              "(see https://docs.nvidia.com/deeplearning/transformer-engine/), or use --fp8-backend torchao")


@dataclass
class Fp8Conversion:
    backend: str
    recipe: str
    emulate: bool
    layers: list[LayerDecision]
    # TransformerEngine needs its own context around the forward pass; torchao does not.
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext, repr=False)
    backend_recipe: str = ""
    fsdp_all_gather: bool = False  # FSDP2 all-gathers FP8 weights: scales are precomputed after each step
    fp8_gathered_weights: int | None = None  # counted at the first step
    rule: str = ""  # how the layers were chosen (the report's size_rule)

    def after_optimizer_step(self, model: nn.Module) -> None:
        if not self.fsdp_all_gather:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        if self.fp8_gathered_weights is None:
            self.fp8_gathered_weights = count_fp8_gathered_weights(model)
            console.print(f"fsdp2: {self.fp8_gathered_weights} weight(s) all-gathered in FP8")
        # The next all-gather needs every weight's FP8 scale: one all-reduce of all amaxes here
        # instead of one per layer inside the forward.
        precompute_float8_dynamic_scale_for_fsdp(model)


def count_fp8_gathered_weights(model: nn.Module) -> int:
    """Sharded weights that FSDP2 casts to FP8 before all-gathering; none means the option did nothing
    (FP8 conversion must come before fully_shard), which would be a bug, not a slow run."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    n = sum(isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)
            for p in model.parameters())
    if n == 0:
        raise RuntimeError("--fp8-fsdp-all-gather: no FSDP2-sharded FP8 weight found; convert to FP8 before "
                           "fully_shard")
    return n


def check_fp8(cfg: PrecisionConfig, device: torch.device) -> None:
    """Refuse FP8 where it cannot run, naming the fix (before any model surgery)."""
    if cfg.fp8_backend == "te":
        if cfg.fp8_emulate:
            raise UserError("--fp8-emulate exists only for --fp8-backend torchao (TransformerEngine has no CPU "
                            "emulation); drop --fp8-emulate or use --fp8-backend torchao")
        problems = []
        try:
            _import_te()
        except UserError as e:
            problems.append(str(e))
        try:
            require_fp8_hardware(device, "--fp8-backend te", emulate_flag=None,
                                 fallback="--fp8-backend torchao --fp8-emulate to check FP8 numerics here")
        except UserError as e:
            problems.append(str(e))
        if problems:  # name every missing piece at once
            raise UserError(" Also: ".join(problems))
    elif not cfg.fp8_emulate:
        require_fp8_hardware(device, "--precision fp8", emulate_flag="--fp8-emulate")


def check_fsdp_all_gather(cfg: PrecisionConfig, parallel: str) -> None:
    """FP8 all-gather is torchao's FSDP2 feature, and its scales are per tensor. `parallel`: the parallel mode."""
    if not cfg.fp8_fsdp_all_gather:
        return
    needs = [(cfg.precision == "fp8", "--precision fp8"),
             (parallel == "fsdp2", "--parallel fsdp2 (under torchrun)"),
             (cfg.fp8_backend == "torchao", "--fp8-backend torchao (TransformerEngine's FSDP integration is not "
              "wired here)"),
             (cfg.fp8_recipe == "tensorwise", "--fp8-recipe tensorwise (torchao all-gathers FP8 weights with one "
              "scale per tensor only)")]
    missing = [flag for ok, flag in needs if not ok]
    if missing:
        raise UserError(f"--fp8-fsdp-all-gather needs {'; '.join(missing)}; add them or drop --fp8-fsdp-all-gather")


@dataclass
class LayerRule:
    """How the layers were chosen: the shape rule with each layer's tokens, or a size rule (report text)."""

    rule: ShapeRule | None
    tokens: dict[str, int] | None
    describe: str


def layer_rule(model: nn.Module, cfg: PrecisionConfig, device: torch.device,
               example_shape: tuple[int, ...] | None) -> LayerRule:
    """The rule for `model` trained on batches of `example_shape` (None: not known)."""
    if cfg.fp8_min_dim:
        return LayerRule(None, None, f"max(in, out) >= --fp8-min-dim {cfg.fp8_min_dim}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    rule = ShapeRule(cfg.fp8_recipe, gpu, MeasuredTable.load(cfg.fp8_table) if cfg.fp8_table else None)
    if example_shape is None:
        return LayerRule(None, None, f"torchao's size rule ({cfg.fp8_recipe}, H100-measured thresholds; tokens per "
                                     "layer not known)")
    try:
        tokens = linear_tokens(model, example_shape)
    except Exception as e:  # a model the shape-only forward cannot run: the size thresholds decide instead
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
        return LayerRule(None, None, f"torchao's size rule ({cfg.fp8_recipe}, H100-measured thresholds; the shape "
                                     f"probe failed: {why})")
    return LayerRule(rule, tokens, f"{rule.describe()}, at each layer's tokens per step for a batch of "
                                   f"{tuple(example_shape)}")


def convert_fp8(model: nn.Module, cfg: PrecisionConfig, device: torch.device, parallel: str = "none",
                example_shape: tuple[int, ...] | None = None) -> Fp8Conversion:
    """Swap the layers the rule chooses for FP8 ones, in place (before FSDP wraps the model). `example_shape`:
    one training batch's shape on this rank, which gives each layer's M for the shape rule."""
    check_fsdp_all_gather(cfg, parallel)
    check_fp8(cfg, device)
    how = layer_rule(model, cfg, device, example_shape)
    layers = eligibility(model, cfg.fp8_recipe, cfg.fp8_min_dim, how.tokens, how.rule)
    chosen = {d.name for d in layers if d.converted}
    if cfg.fp8_fsdp_all_gather and not chosen:  # otherwise it would only surface after the first step
        raise UserError("--fp8-fsdp-all-gather: this model has no layer that FP8 converts (see the layer report: "
                        f"only nn.Linear layers with dimensions divisible by 16 and {how.describe}), so no weight "
                        "could be all-gathered in FP8; set a lower --fp8-min-dim, use a model with such layers, "
                        "or drop --fp8-fsdp-all-gather")
    conversion = _convert_te(model, cfg, chosen, layers) if cfg.fp8_backend == "te" else \
        _convert_torchao(model, cfg, chosen, layers)
    conversion.rule = how.describe
    return conversion


def _convert_torchao(model: nn.Module, cfg: PrecisionConfig, chosen: set[str], layers: list[LayerDecision]):
    require_torchao("--precision fp8 --fp8-backend torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe)
    if cfg.fp8_emulate:  # emulated casts and matmuls: same numerics, runs on CPU and older GPUs
        config = dataclasses.replace(config, emulate=True)
    if cfg.fp8_fsdp_all_gather:  # weights become tensors that FSDP2 casts to FP8 before all-gathering
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    converted = convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    if converted is not model:
        raise UserError("FP8 conversion replaced the whole model (a bare nn.Linear); wrap it in a module")
    _check_swapped(model, chosen, "Float8Linear")
    return Fp8Conversion("torchao", cfg.fp8_recipe, cfg.fp8_emulate, layers, backend_recipe=f"torchao {cfg.fp8_recipe}",
                         fsdp_all_gather=cfg.fp8_fsdp_all_gather)


def _import_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise UserError(f"--fp8-backend te: TransformerEngine is not installed or does not load ({e}); "
                        f"{TE_INSTALL}") from None
    return te


def _te_recipe(recipe: str):
    from transformer_engine.common import recipe as te_recipe

    if recipe == "tensorwise":  # per-tensor scales computed from the current tensor, like torchao tensorwise
        return te_recipe.Float8CurrentScaling()
    return te_recipe.Float8BlockScaling()  # TE's finer-grained (1x128 block) scaling: its rowwise counterpart


def _convert_te(model: nn.Module, cfg: PrecisionConfig, chosen: set[str], layers: list[LayerDecision]):
    te = _import_te()

    class PlainStateLinear(te.Linear):
        """te.Linear whose state dict is just weight/bias, so checkpoints stay portable to plain nn.Linear.
        With current/block scaling recipes TE keeps no amax history that would need saving."""

        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old: nn.Linear = getattr(parent, child)
        new = PlainStateLinear(old.in_features, old.out_features, bias=old.bias is not None,
                               params_dtype=old.weight.dtype, device=old.weight.device)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, child, new)
    recipe = _te_recipe(cfg.fp8_recipe)
    context = lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # noqa: E731
    return Fp8Conversion("te", cfg.fp8_recipe, False, layers, context, f"TransformerEngine {type(recipe).__name__}")


def _check_swapped(model: nn.Module, chosen: set[str], type_name: str) -> None:
    swapped = {n for n, m in model.named_modules() if type(m).__name__ == type_name}
    if swapped != chosen:
        raise RuntimeError(f"FP8 conversion swapped {sorted(swapped)} but the eligibility rule chose {sorted(chosen)}")


def fp8_hardware_note(device: torch.device, emulate: bool) -> str:
    if emulate:
        return f"emulated on {describe_device(device)}: a numerics check, no speed-up"
    return describe_device(device) + ("" if has_fp8_hardware(device) else " (no FP8 tensor cores)")

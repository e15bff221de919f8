"""Which layers FP8 training converts, and why the others are skipped: the rule applied to every layer
(no torchao, no model surgery), so it is checked against torchao's own filter and read by the report;
fp8.py applies it with a backend.

FP8 GEMMs (torch._scaled_mm, TransformerEngine) need both matrix dimensions divisible by 16,
and pay only when the GEMM is large enough for the cast overhead to amortize. When the tokens each
layer sees per step are known (`linear_tokens`: one shape-only forward of the training batch), the
shape rule of fp8_rule.py decides from (M, K, N): a measured table or torchao's roofline. Without
them, torchao's size thresholds, measured on H100 per recipe (torchao.float8 README,
`_auto_filter_for_recipe`). `min_dim` replaces both with "the larger dimension >= min_dim".
Only nn.Linear is converted: convolutions stay in high precision, and the report says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from torchcls.precision.fp8_rule import ShapeRule

LISTED_NON_LINEAR = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class LayerDecision:
    name: str
    type: str
    in_features: int
    out_features: int
    converted: bool
    reason: str
    tokens: int | None = None  # M: rows through the layer per step (None: not measured)
    speedup: float | None = None  # what the shape rule expects (measured or roofline ceiling), when it decided

    def to_dict(self) -> dict:
        return asdict(self)


def size_reason(recipe: str, n: int, k: int, min_dim: int) -> str | None:
    """Why an (N out, K in) GEMM is too small for FP8 to pay, or None when it is large enough."""
    if min_dim:
        return None if max(n, k) >= min_dim else f"too small: max(in, out) = {max(n, k)} < --fp8-min-dim {min_dim}"
    if recipe == "tensorwise":  # torchao: skip when K <= 4096 and N <= 1024
        return f"too small for FP8 to pay: in {k} <= 4096 and out {n} <= 1024 (torchao tensorwise rule)" \
            if k <= 4096 and n <= 1024 else None
    if n <= 2048:  # rowwise thresholds, torchao
        return f"too small for FP8 to pay: out {n} <= 2048 (torchao rowwise rule)"
    if k <= 1024:
        return f"too small for FP8 to pay: in {k} <= 1024 (torchao rowwise rule)"
    if n <= 4096 and k <= 2048:
        return f"too small for FP8 to pay: out {n} <= 4096 and in {k} <= 2048 (torchao rowwise rule)"
    return None


def decide(name: str, module: nn.Module, recipe: str, min_dim: int, tokens: int | None = None,
           rule: ShapeRule | None = None) -> LayerDecision | None:
    """The decision for one module; None for modules that are not listed (norms, activations...).
    `tokens` (M) and `rule`: the shape rule decides (unless `min_dim` is set); else torchao's thresholds."""
    if isinstance(module, nn.Linear):
        n, k = module.out_features, module.in_features
        if n % 16 or k % 16:
            return LayerDecision(name, type(module).__name__, k, n, False,
                                 f"in {k} / out {n} not divisible by 16 (FP8 GEMM requirement)", tokens)
        if tokens and rule is not None and not min_dim:
            ok, speedup, why = rule.verdict(tokens, k, n)
            return LayerDecision(name, type(module).__name__, k, n, ok, why, tokens, round(speedup, 3))
        reason = size_reason(recipe, n, k, min_dim)
        return LayerDecision(name, type(module).__name__, k, n, reason is None, reason or "eligible", tokens)
    if isinstance(module, LISTED_NON_LINEAR):
        return LayerDecision(name, type(module).__name__, module.in_channels, module.out_channels, False,
                             f"{type(module).__name__} stays high precision: FP8 converts only nn.Linear")
    return None


def eligibility(model: nn.Module, recipe: str, min_dim: int, tokens: dict[str, int] | None = None,
                rule: ShapeRule | None = None) -> list[LayerDecision]:
    tokens = tokens or {}
    return [d for name, m in model.named_modules()
            if (d := decide(name, m, recipe, min_dim, tokens.get(name), rule)) is not None]


def linear_tokens(model: nn.Module, example_shape: tuple[int, ...]) -> dict[str, int]:
    """M of every nn.Linear: the rows its input has for one training batch of `example_shape` (tokens x
    images for a ViT block, images for a head). Shapes only: the forward runs on fake tensors (no compute,
    no change to weights, buffers or the random state), in eval mode, which is restored."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tokens: dict[str, int] = {}

    def record(name: str):
        return lambda mod, inp, out: tokens.__setitem__(name, inp[0].shape[:-1].numel())

    hooks = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    modes = {m: m.training for m in model.modules()}
    param = next(iter(model.parameters()), None)
    try:
        model.eval()
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            model(torch.empty(example_shape, device=param.device if param is not None else "cpu"))
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return tokens


def summary(decisions: list[LayerDecision]) -> dict:
    linear = [d for d in decisions if d.type not in {c.__name__ for c in LISTED_NON_LINEAR}]
    return {"converted": sum(d.converted for d in decisions), "linear_layers": len(linear),
            "other_layers_not_converted": len(decisions) - len(linear)}

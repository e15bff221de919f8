"""Which layers FP8 training converts, and why the others are skipped: the rule alone (no torchao,
no model surgery), so it is checked against torchao's own filter and read by the report; fp8.py
applies it with a backend.

FP8 GEMMs (torch._scaled_mm, TransformerEngine) need both matrix dimensions divisible by 16,
and pay only when the GEMM is large enough for the cast overhead to amortize. The default
size thresholds are torchao's, measured on H100 per recipe (torchao.float8 README,
`_auto_filter_for_recipe`); `min_dim` replaces them with "the larger dimension >= min_dim".
Only nn.Linear is converted: convolutions stay in high precision, and the report says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

LISTED_NON_LINEAR = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class LayerDecision:
    name: str
    type: str
    in_features: int
    out_features: int
    converted: bool
    reason: str

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


def decide(name: str, module: nn.Module, recipe: str, min_dim: int) -> LayerDecision | None:
    """The decision for one module; None for modules that are not listed (norms, activations...)."""
    if isinstance(module, nn.Linear):
        n, k = module.out_features, module.in_features
        if n % 16 or k % 16:
            reason = f"in {k} / out {n} not divisible by 16 (FP8 GEMM requirement)"
        else:
            reason = size_reason(recipe, n, k, min_dim)
        return LayerDecision(name, type(module).__name__, k, n, reason is None, reason or "eligible")
    if isinstance(module, LISTED_NON_LINEAR):
        return LayerDecision(name, type(module).__name__, module.in_channels, module.out_channels, False,
                             f"{type(module).__name__} stays high precision: FP8 converts only nn.Linear")
    return None


def eligibility(model: nn.Module, recipe: str, min_dim: int) -> list[LayerDecision]:
    return [d for name, m in model.named_modules() if (d := decide(name, m, recipe, min_dim)) is not None]


def summary(decisions: list[LayerDecision]) -> dict:
    linear = [d for d in decisions if d.type not in {c.__name__ for c in LISTED_NON_LINEAR}]
    return {"converted": sum(d.converted for d in decisions), "linear_layers": len(linear),
            "other_layers_not_converted": len(decisions) - len(linear)}

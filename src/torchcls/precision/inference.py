"""Inference precision for deployment paths (predict, export, compile): one function turns an fp32
eager model into a reduced-precision one, and one measures its parity against the fp32 model.

- bf16: weights in bf16, inputs cast in and logits cast out (CPU with AVX-512-bf16, any modern GPU).
- int8: torchao dynamic int8 activations x int8 weights for CPU. It pays only under torch.compile
  (Inductor fuses the quantize/matmul/dequantize); in eager mode it is slower than fp32.
- fp8: torchao float8 dynamic activations x float8 weights (tensorwise or rowwise scales) for GPUs
  with compute capability >= 8.9; torchao has no CPU path for it, so there is no emulation here.
torchao quantizes nn.Linear only: convolutions stay in their float dtype, and the layer report says so.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchcls.errors import UserError
from torchcls.precision.hardware import describe_device, require_bf16, require_fp8_hardware, require_torchao

INFERENCE_PRECISIONS = ("fp32", "bf16", "int8", "fp8")
# Default parity bounds: (max |Δlogit| relative to max |logit| of the fp32 model, min top-1 agreement).
PARITY_BOUNDS = {"fp32": (1e-5, 1.0), "bf16": (0.05, 0.95), "int8": (0.05, 0.95), "fp8": (0.1, 0.95)}


class CastIO(nn.Module):
    """Cast inputs to the weights' dtype and logits back to fp32, so callers keep feeding fp32 images.
    Plain tensor ops: exportable with torch.export and compilable."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype)).float()


@dataclass
class InferencePrecision:
    model: nn.Module  # ready to run (or to torch.compile / torch.export); eval mode
    precision: str
    device: str
    layers: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict[str, Any]:
        quantized = [entry["name"] for entry in self.layers if entry["quantized"]]
        return {"precision": self.precision, "device": self.device, "note": self.note,
                "quantized_layers": len(quantized), "listed_layers": len(self.layers), "layers": self.layers}


def apply_inference_precision(model: nn.Module, precision: str, device: str | torch.device = "cpu", *,
                              fp8_recipe: str = "tensorwise", inplace: bool = False) -> InferencePrecision:
    """Return `model` converted for inference in `precision` (a copy unless inplace), in eval mode on `device`."""
    device = torch.device(device)
    if precision not in INFERENCE_PRECISIONS:
        raise UserError(f"inference precision {precision!r}: choose one of {', '.join(INFERENCE_PRECISIONS)}")
    m = (model if inplace else copy.deepcopy(model)).eval().to(device)
    if precision == "fp32":
        return InferencePrecision(m, precision, str(device), _layers(m, precision))
    if precision == "bf16":
        require_bf16(device)
        inner = m.to(torch.bfloat16)
        return InferencePrecision(CastIO(inner, torch.bfloat16), precision, str(device), _layers(inner, precision),
                                  "bf16 weights and activations")
    require_torchao(f"{precision} inference")
    from torchao.quantization import quantize_

    if precision == "int8":
        if device.type != "cpu":
            raise UserError(f"int8 inference is the CPU path ({describe_device(device)} given); on a GPU use "
                            "fp8 (compute capability >= 8.9) or bf16")
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        quantize_(m, Int8DynamicActivationInt8WeightConfig())
        return InferencePrecision(m, precision, str(device), _layers(m, precision),
                                  "int8 dynamic: pays only under torch.compile; eager is slower than fp32")
    require_fp8_hardware(device, "fp8 inference", emulate_flag=None,
                         fallback="bf16 (GPU or CPU) or int8 (CPU) inference precision")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    granularity = PerTensor() if fp8_recipe == "tensorwise" else PerRow()
    inner = m.to(torch.bfloat16)  # rowwise float8 needs bf16 high-precision weights
    quantize_(inner, Float8DynamicActivationFloat8WeightConfig(granularity=granularity))
    return InferencePrecision(CastIO(inner, torch.bfloat16), precision, str(device), _layers(inner, precision),
                              f"float8 {fp8_recipe} dynamic activations and weights; best under torch.compile")


def _layers(model: nn.Module, precision: str) -> list[dict[str, Any]]:
    """Per Linear/conv layer: whether its weight was quantized (a torchao tensor subclass) and why not."""
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            continue
        weight_type = type(module.weight)
        quantized = weight_type not in (torch.Tensor, nn.Parameter)
        if quantized:
            why = "quantized"
        elif precision in ("fp32", "bf16"):
            why = f"{precision}: no quantization"
        elif not isinstance(module, nn.Linear):
            why = "convolution: torchao quantize_ converts nn.Linear only"
        else:
            why = "dims not divisible by 16 (float8 GEMM requirement)"
        out.append({"name": name, "type": type(module).__name__, "weight": weight_type.__name__,
                    "dtype": str(getattr(module.weight, "dtype", "")).removeprefix("torch."),
                    "quantized": quantized, "why": why})
    return out


@torch.no_grad()
def inference_parity(reference: nn.Module, candidate: nn.Module, batches: Iterable[torch.Tensor] | torch.Tensor,
                     precision: str | None = None, bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """Max |Δlogit| and top-1 agreement of `candidate` against the fp32 eager `reference` on the same inputs.

    `passed` says whether the figures are inside `bounds` (relative max |Δlogit|, min top-1 agreement),
    by default PARITY_BOUNDS[precision]."""
    reference.eval()
    candidate.eval()
    if isinstance(batches, torch.Tensor):
        batches = [batches]
    max_diff, max_ref, agree, n = 0.0, 0.0, 0, 0
    for x in batches:
        ref = reference(x).float()
        out = candidate(x).float()
        max_diff = max(max_diff, (out - ref).abs().max().item())
        max_ref = max(max_ref, ref.abs().max().item())
        agree += (out.argmax(1) == ref.argmax(1)).sum().item()
        n += len(x)
    if n == 0:
        raise UserError("parity needs at least one input batch")
    rel = max_diff / max(max_ref, 1e-12)
    result = {"max_abs_logit_diff": max_diff, "max_rel_logit_diff": rel, "top1_agreement": agree / n, "n": n}
    if bounds is None and precision is not None:
        bounds = PARITY_BOUNDS[precision]
    if bounds is not None:
        result |= {"bound_rel_logit_diff": bounds[0], "bound_top1_agreement": bounds[1],
                   "passed": rel <= bounds[0] and agree / n >= bounds[1]}
    return result


def quantize_for_inference(model: nn.Module, precision: str, example_batches: Iterable[torch.Tensor] | torch.Tensor,
                           device: str | torch.device = "cpu", *, fp8_recipe: str = "tensorwise",
                           bounds: tuple[float, float] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Convert and verify in one call (for export/compile paths): returns the model and a report with the
    layer list and parity against the fp32 eager model. Raises UserError when parity fails its bound."""
    reference = copy.deepcopy(model).eval().to(device).float()
    result = apply_inference_precision(model, precision, device, fp8_recipe=fp8_recipe)
    if isinstance(example_batches, torch.Tensor):
        example_batches = [example_batches]
    batches = [x.to(device) for x in example_batches]
    parity = inference_parity(reference, result.model, batches, precision, bounds)
    report = result.summary() | {"parity": parity}
    if not parity["passed"]:
        raise UserError(f"{precision} inference failed parity against fp32: max |Δlogit| {parity['max_abs_logit_diff']:.4g} "
                        f"(relative {parity['max_rel_logit_diff']:.3g}, bound {parity['bound_rel_logit_diff']}), "
                        f"top-1 agreement {parity['top1_agreement']:.3f} (bound {parity['bound_top1_agreement']}); "
                        "use a higher precision for this model")
    return result.model, report


def heldout_batches(checkpoint: str, n: int = 64, batch_size: int = 32) -> list[torch.Tensor]:
    """Up to `n` real held-out images of a checkpoint's training data (its seeded val split),
    preprocessed as at training: the inputs parity should be measured on."""
    from torchcls.config import Config
    from torchcls.data import eval_dataset, make_loader
    from torchcls.checkpoint.files import read_meta, resolve_checkpoint

    meta = read_meta(resolve_checkpoint(checkpoint))
    cfg = Config.from_dict(meta.config, origin=f"{checkpoint} metadata")
    dataset, _ = eval_dataset(cfg.data, meta.preprocess, "val", cfg.train.seed)
    batches, seen = [], 0
    for x, _ in make_loader(dataset, batch_size, 0, shuffle=False):
        batches.append(x[: n - seen])
        seen += len(batches[-1])
        if seen >= n:
            break
    return batches

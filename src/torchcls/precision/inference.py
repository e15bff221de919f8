"""Inference precision for deployment paths (predict, export, compile): `CastIO`, the one bf16/fp16
inference wrapper, and `apply_inference_precision`, which turns an fp32 eager model into a
reduced-precision one. Parity against the fp32 model is measured by torchcls.artifacts.parity.compare,
and "quantize, then check parity on held-out images" is torchcls.artifacts.quantize.quantize_for_inference.

- bf16: weights in bf16, inputs cast in and logits cast out (CPU with AVX-512-bf16, any modern GPU).
- int8: torchao dynamic int8 activations x int8 weights for CPU. It pays only under torch.compile
  (Inductor fuses the quantize/matmul/dequantize); in eager mode it is slower than fp32.
- fp8: torchao float8 dynamic activations x float8 weights (tensorwise or rowwise scales) for GPUs
  with compute capability >= 8.9; torchao has no CPU path for it, so there is no emulation here.
torchao quantizes nn.Linear only: convolutions stay in their float dtype, and the layer report says so.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchcls.errors import UserError
from torchcls.precision.dtypes import DTYPES
from torchcls.precision.hardware import (
    PrecisionChoice,
    choose_precision,
    cpu_int8_matmul_exact,
    describe_device,
    require_bf16,
    require_fp8_hardware,
    require_torchao,
)

INFERENCE_PRECISIONS = ("fp32", "bf16", "int8", "fp8")


class CastIO(nn.Module):
    """float32 images in, float32 logits out, whatever the dtype inside: the input is cast to `dtype` on
    entry and the logits back to float32, so callers never see the internal dtype. The inner model's
    floating-point weights are cast to `dtype` in place (weights already in `dtype`, such as torchao's
    quantized ones, are left alone) and it is put in eval mode. Plain tensor ops: exportable with
    torch.export and compilable."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype | str):
        super().__init__()
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        tensors = [*inner.parameters(), *inner.buffers()]
        if any(t.is_floating_point() and t.dtype != dtype for t in tensors):
            inner = inner.to(dtype)
        self.inner, self.dtype = inner, dtype
        self.eval()

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
        wrapped = CastIO(m, DTYPES["bf16"])
        return InferencePrecision(wrapped, precision, str(device), _layers(wrapped.inner, precision),
                                  "bf16 weights and activations")
    require_torchao(f"{precision} inference")
    from torchao.quantization import quantize_

    if precision == "int8":
        if device.type != "cpu":
            raise UserError(f"int8 inference is the CPU path ({describe_device(device)} given); on a GPU use "
                            "fp8 (compute capability >= 8.9) or bf16")
        if not cpu_int8_matmul_exact():
            raise UserError("int8 inference: this CPU's int8 matrix multiply (oneDNN, without VNNI) saturates and "
                            "gives wrong sums, so the model's outputs would be wrong; use fp32 here, or "
                            "`torchcls export --target executorch --quantize int8` (XNNPACK kernels, not oneDNN)")
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        quantize_(m, Int8DynamicActivationInt8WeightConfig())
        return InferencePrecision(m, precision, str(device), _layers(m, precision),
                                  "int8 dynamic: pays only under torch.compile; eager is slower than fp32")
    require_fp8_hardware(device, "fp8 inference", emulate_flag=None,
                         fallback="bf16 (GPU or CPU) or int8 (CPU) inference precision")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    granularity = PerTensor() if fp8_recipe == "tensorwise" else PerRow()
    inner = m.to(DTYPES["bf16"])  # rowwise float8 needs bf16 high-precision weights
    quantize_(inner, Float8DynamicActivationFloat8WeightConfig(granularity=granularity))
    return InferencePrecision(CastIO(inner, DTYPES["bf16"]), precision, str(device), _layers(inner, precision),
                              f"float8 {fp8_recipe} dynamic activations and weights; best under torch.compile")


def eager_for_inference(model: nn.Module, requested: str, device: torch.device,
                        fp32_only: str = "") -> tuple[nn.Module, PrecisionChoice]:
    """`model` (fp32, on `device`) ready for eager inference in `requested` (auto, fp32 or bf16): auto is bf16
    where the hardware computes it natively (choose_precision), except where `fp32_only` says why a model must
    stay fp32 (early-exit models: their exit decisions are checked in fp32). bf16 runs behind CastIO: float32
    images in, float32 logits out, so callers see no difference but speed and the last digits."""
    if requested not in ("auto", "fp32", "bf16"):
        raise UserError(f"--precision {requested}: eager inference runs in auto, fp32 or bf16")
    choice = choose_precision(requested, device, kind="inference")
    if choice.precision == "bf16" and fp32_only and requested == "auto":
        choice = PrecisionChoice("auto", "fp32", f"{choice.reason}, but {fp32_only}")
    if choice.precision == "bf16":
        require_bf16(device)
        model = CastIO(model, DTYPES["bf16"])
    return model.eval(), choice


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

"""Precision is applied from outside the model: one function turns the config into an autocast
context (and a gradient scaler where one is needed). Master weights stay fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from torchcls.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionPlan:
    name: str
    device_type: str

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=DTYPES[self.name])


def apply_precision(precision: str, device: torch.device) -> PrecisionPlan:
    if precision not in ("fp32", *DTYPES):
        raise UserError(f"--precision {precision}: supported here are fp32 and bf16")
    if precision == "fp16" and device.type != "cuda":
        raise UserError("--precision fp16 needs a CUDA GPU (fp16 autocast on CPU is slow and unscaled); "
                        "use --precision bf16 on CPU")
    return PrecisionPlan(precision, device.type)

"""What this machine can do in reduced precision, with messages that name the fix."""

from __future__ import annotations

import torch

from torchcls.errors import UserError
from torchcls.extras import missing_extra

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (sm_90), Blackwell (sm_100+): the GPUs with FP8 tensor cores


def describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{device.type} (no CUDA GPU)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def has_fp8_hardware(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def require_fp8_hardware(device: torch.device, what: str, emulate_flag: str | None,
                         fallback: str = "--precision bf16") -> None:
    """Raise a UserError unless `device` has FP8 tensor cores."""
    if has_fp8_hardware(device):
        return
    hint = (f", or add {emulate_flag} to run torchao's FP8 emulation (checks numerics; slower, not faster)"
            if emulate_flag else "")
    raise UserError(f"{what} needs an NVIDIA GPU with compute capability >= 8.9 (L4/L40/RTX 40xx, H100/H200, "
                    f"B200); the device here is {describe_device(device)}. Use {fallback}{hint}.")


def require_bf16(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision bf16: {describe_device(device)} has no bf16 support (needs compute "
                        "capability >= 8.0); use --precision fp16 on this GPU")


def require_fp16(device: torch.device) -> None:
    if device.type != "cuda":
        raise UserError("--precision fp16 needs a CUDA GPU (fp16 autocast on CPU is slow and needs loss "
                        "scaling); use --precision bf16 on CPU")


def require_torchao(what: str) -> None:
    """torchao is an optional extra; say how to get it instead of an ImportError traceback."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise missing_extra("precision", what, "torchao") from None

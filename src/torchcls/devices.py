"""Device selection with clear errors: one parser for every `--device` (train, evaluate, predict, export,
serve), and what an artifact records about the device it was built for.

Names: auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda (the current GPU) and cuda:N.
`parse_device` only reads the name (no hardware query: testable anywhere); `resolve_device` also checks
that this machine has the device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from torchcls.errors import UserError

_NAME = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def parse_device(name: str, flag: str = "--device") -> str | torch.device:
    """'auto' stays the string 'auto'; cpu, cuda and cuda:N become torch.device. Nothing is queried."""
    m = _NAME.match(str(name).strip().lower())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise UserError(f"{flag} {name!r} is not a device name; use auto, cpu, cuda or cuda:N (N = GPU index)")
    if m.group(1) == "auto":
        return "auto"
    return torch.device(m.group(1), int(m.group(2))) if m.group(2) is not None else torch.device(m.group(1))


def resolve_device(name: str | torch.device, flag: str = "--device") -> torch.device:
    """The device `name` means on this machine; a CUDA device that is not here is a UserError."""
    device = parse_device(str(name), flag)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert isinstance(device, torch.device)
    if device.type == "cuda":
        require_cuda(device, flag)
    return device


def require_cuda(device: torch.device, flag: str = "--device") -> None:
    if not torch.cuda.is_available():
        built = "this torch has no CUDA support" if torch.version.cuda is None else \
            "no CUDA GPU is visible (driver missing, or CUDA_VISIBLE_DEVICES hides it)"
        raise UserError(f"{flag} {device}: needs an NVIDIA GPU with a working CUDA driver; {built}. Use {flag} cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UserError(f"{flag} {device}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")


@dataclass(frozen=True)
class BuildDevice:
    """What an artifact records about where it was compiled: device type, and for CUDA the compute capability
    ("9.0") and GPU name. Compiled CUDA code (AOTInductor cubins) runs only on GPUs of that capability."""

    type: str = "cpu"  # "cpu" | "cuda"
    capability: str = ""
    gpu: str = ""

    @classmethod
    def of(cls, device: torch.device) -> BuildDevice:
        if device.type != "cuda":
            return cls("cpu")
        major, minor = torch.cuda.get_device_capability(device)
        return cls("cuda", f"{major}.{minor}", torch.cuda.get_device_name(device))

    def describe(self) -> str:
        return "the CPU" if self.type == "cpu" else f"CUDA compute capability {self.capability} ({self.gpu})"


def capability_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"

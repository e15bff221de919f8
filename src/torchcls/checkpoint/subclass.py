"""The tensor inside a wrapper tensor subclass, for writers that need storage (safetensors, DCP's HF format).

torchao's weight that FSDP2 all-gathers in FP8 is a wrapper subclass holding one plain tensor and no storage
of its own (torch 2.11 + torchao 0.17 hand it out from the full state dict). A wrapper is recognised by
PyTorch's documented subclass protocol (`__tensor_flatten__` names the inner tensors' attributes), not by
torch's private helper. A DTensor is never unwrapped: its local tensor is a shard, not the weight.
"""

from __future__ import annotations

import torch


def inner_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` unwrapped while it is a wrapper subclass around exactly one tensor (not a DTensor); else `t`."""
    from torch.distributed.tensor import DTensor

    while (type(t) is not torch.Tensor and not isinstance(t, DTensor) and hasattr(t, "__tensor_flatten__")
           and len(inner := t.__tensor_flatten__()[0]) == 1):
        t = getattr(t, inner[0])
    return t

"""The compile call the benchmark measures, kept in one place so the shared inference compile policy
(`compile_for_inference` of the export work) can replace it with a one-line change.

Why these settings (STACK.md): Inductor's freezing (constant-folds weights, pre-packs conv/linear
weights) only applies through the global config flag (the `options=` argument ignores it), and
only when the first call runs under no_grad; without it CPU inference often loses to eager.
"""

from __future__ import annotations

import torch
from torch import nn


def compile_for_inference(model: nn.Module, mode: str = "default") -> nn.Module:
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    return torch.compile(model.eval(), mode=None if mode == "default" else mode)

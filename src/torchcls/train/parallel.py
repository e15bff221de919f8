"""Parallelism is applied to a built model from outside its code (as torchtitan does).

Only single-process training exists so far; DDP/FSDP2 plug in here.
"""

from __future__ import annotations

from torch import nn

from torchcls.config import TrainConfig
from torchcls.errors import UserError


def parallelize(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    if cfg.parallel != "none":
        raise UserError(f"--parallel {cfg.parallel} is not supported yet")
    return model

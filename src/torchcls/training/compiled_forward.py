"""torch.compile for training: decided here, in one place, and applied to the model's forward."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from torchcls.config import PrecisionConfig, TrainConfig
from torchcls.precision.training import FP8_COMPILE_NOTE, fp8_wants_compile
from torchcls.training.graph_breaks import report_graph_breaks


def should_compile(train: TrainConfig, precision: PrecisionConfig) -> tuple[bool, str]:
    """Whether to compile the training model, and why when --compile did not ask for it
    (torchao FP8 pays only when compile fuses its scaling and casts: it asks for it)."""
    if train.compile:
        return True, ""
    if fp8_wants_compile(precision):
        return True, FP8_COMPILE_NOTE
    return False, ""


def compile_for_training(model: nn.Module, train_set: Dataset, run_path: Path, device: torch.device,
                         memory_format: torch.memory_format, report_breaks: bool) -> nn.Module:
    """The compiled forward (the model itself keeps its parameters, state dict and checkpoints).
    `report_breaks`: write graph_breaks.json first (explain() runs forwards: not under FSDP's collectives)."""
    if report_breaks:
        report_graph_breaks(model, train_set, run_path, device, memory_format)
    return torch.compile(model)

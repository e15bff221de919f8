"""One loader for every inference artifact: `load_artifact(path)` -> a callable with its `ArtifactInfo`.

This version reads eager artifacts only (a .safetensors checkpoint or a run dir); the export
feature adds .pt2 (AOTInductor) and .onnx behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from torchcls.data import Preprocess
from torchcls.errors import UserError

EAGER_MAX_BATCH = 64


@dataclass
class ArtifactInfo:
    name: str
    target: str  # "aoti" | "onnx" | "executorch" | "eager"
    classes: list[str]
    preprocess: Preprocess
    max_batch: int
    precision: str


class LoadedArtifact(Protocol):
    info: ArtifactInfo

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """float32 NCHW normalised input -> float32 logits; batch > max_batch or wrong shape -> UserError."""


def check_input(x: torch.Tensor, info: ArtifactInfo) -> None:
    pre = info.preprocess
    expected = (pre.channels, pre.img_size, pre.img_size)
    if x.dtype != torch.float32:
        raise UserError(f"{info.name}: input dtype {x.dtype} is not supported; the model takes float32")
    if x.ndim != 4 or tuple(x.shape[1:]) != expected:
        raise UserError(f"{info.name}: input shape {tuple(x.shape)} does not match (N, {', '.join(map(str, expected))})")
    if not 1 <= x.shape[0] <= info.max_batch:
        raise UserError(f"{info.name}: batch {x.shape[0]} is outside 1..{info.max_batch}; split the input")


class EagerArtifact:
    """The checkpoint's nn.Module in eval mode, called under inference_mode."""

    def __init__(self, model: torch.nn.Module, info: ArtifactInfo):
        self.model, self.info = model, info

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.info)
        with torch.inference_mode():
            return self.model(x).float()


def load_artifact(path: str | Path) -> LoadedArtifact:
    from torchcls.train.checkpoint import load_model, resolve_checkpoint, run_dir_of

    path = Path(path)
    if not path.exists():
        raise UserError(f"artifact {path} does not exist; pass a .pt2, .onnx or .safetensors file or a run dir")
    if path.is_file() and path.suffix in (".pt2", ".onnx"):
        raise UserError(f"{path}: this build of torchcls loads only eager artifacts (.safetensors or a run dir)")
    if path.is_file() and path.suffix != ".safetensors":
        raise UserError(f"{path}: unknown artifact type {path.suffix!r}; expected .pt2, .onnx, .safetensors "
                        "or a run dir")
    checkpoint = resolve_checkpoint(path)
    model, meta = load_model(checkpoint)
    run_dir = run_dir_of(checkpoint)
    name = run_dir.name if run_dir is not None else checkpoint.stem
    info = ArtifactInfo(name=name, target="eager", classes=list(meta.classes), preprocess=meta.preprocess,
                        max_batch=EAGER_MAX_BATCH, precision="fp32")
    return EagerArtifact(model, info)

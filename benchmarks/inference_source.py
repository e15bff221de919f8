"""What benchmarks/inference.py measures on: a timm model with random weights at 224 px (the default; nothing is
downloaded), or a trained checkpoint (`--checkpoint RUN`).

Random weights have near-tied logits, so their agreement probe is strict and says little about int8 (which only
a trained network's decisions can judge), and int8 calibrates on random inputs. A checkpoint brings its own model,
input size, channels and classes; its probe is held-out images of its own data (as `torchcls export`'s parity
reads them) and int8 (torchcls' and ONNX Runtime's alike) calibrates on its training images (as export does), and
its `default` path is `torchcls export RUN` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

MODELS = {"resnet18": "resnet18", "resnet50": "resnet50", "mobilenetv3": "mobilenetv3_large_100",
          "convnext_tiny": "convnext_tiny", "vit_small": "vit_small_patch16_224"}
SIZE = 224
PROBE = 32  # random agreement inputs, seed 1
PROBE_HELD_OUT = 256  # a checkpoint's held-out images
CALIBRATION_SEED = 2  # random calibration inputs: drawn apart from the probe
CALIBRATION_IMAGES = 32


@dataclass(frozen=True)
class Source:
    """`name`: a key of MODELS, or a checkpoint (a .safetensors file or a run dir)."""

    name: str

    @property
    def checkpoint(self) -> Path | None:
        return None if self.name in MODELS else Path(self.name)

    @cached_property
    def meta(self):  # read once per Source: every shape and label asks for it
        from torchcls.checkpoint.files import read_meta, resolve_checkpoint

        return read_meta(resolve_checkpoint(self.checkpoint))

    @property
    def label(self) -> str:
        return self.name if self.checkpoint is None else f"{self.meta.spec.name} ({self.name})"

    def shape(self, batch: int) -> tuple[int, int, int, int]:
        if self.checkpoint is None:
            return batch, 3, SIZE, SIZE
        p = self.meta.preprocess
        return batch, p.channels, p.img_size, p.img_size

    def model(self) -> torch.nn.Module:
        if self.checkpoint is not None:
            from torchcls.checkpoint.files import load_model

            return load_model(self.checkpoint)[0].eval()
        from torchcls.models import ModelSpec, create_model

        torch.manual_seed(0)
        return create_model(ModelSpec(MODELS[self.name], 1000, 3, SIZE)).eval()

    def info(self, target: str, max_batch: int, precision: str):
        from torchcls.artifacts.targets.base import ArtifactInfo
        from torchcls.data import Preprocess

        if self.checkpoint is None:
            return ArtifactInfo(self.name, target, [str(i) for i in range(1000)],
                                Preprocess(SIZE, 3, (0.5,) * 3, (0.5,) * 3), max_batch, precision)
        meta = self.meta
        return ArtifactInfo(meta.spec.name, target, list(meta.classes), meta.preprocess, max_batch, precision)

    def probe(self) -> torch.Tensor:
        """The inputs every path's top-1 agreement with eager fp32 is measured on."""
        if self.checkpoint is None:
            return torch.randn(PROBE, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
        from torchcls.artifacts.parity import held_out_images

        return held_out_images(self.meta, PROBE_HELD_OUT)[0]

    def calibration(self) -> torch.Tensor:
        """The int8 paths' calibration inputs (torchcls' aoti int8 and ONNX Runtime's)."""
        if self.checkpoint is None:
            return torch.randn(CALIBRATION_IMAGES, 3, SIZE, SIZE,
                               generator=torch.Generator().manual_seed(CALIBRATION_SEED))
        from torchcls.artifacts.quantize import calibration_images

        return calibration_images(self.meta, None)

    def calibration_note(self) -> str:
        return (f"{CALIBRATION_IMAGES} random calibration inputs" if self.checkpoint is None
                else "the checkpoint's training images, as `torchcls export` calibrates")

    def gflop(self) -> float:
        """Forward GFLOP per image."""
        from torch.utils.flop_counter import FlopCounterMode

        model = self.model()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.randn(*self.shape(1)))
        return counter.get_total_flops() / 1e9

"""From an eager model to an artifact file: one torch.export capture with a dynamic batch dimension,
then AOTInductor (`.pt2`) or the ONNX dynamo exporter (`.onnx`), each with the torchcls metadata
embedded (see torchcls.artifacts.artifact for where it lives in each format).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchcls.errors import UserError
from torchcls.artifacts.artifact import META_KEY, ArtifactInfo

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class InferenceModule(nn.Module):
    """What every artifact computes: float32 normalised images → float32 logits, whatever the
    precision inside. bf16 artifacts hold bf16 weights and cast the input on entry, so callers
    never see the internal dtype."""

    def __init__(self, model: nn.Module, precision: str):
        super().__init__()
        self.dtype = DTYPES[precision]
        self.model = model.to(self.dtype).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.to(self.dtype)).float()


def capture(model: nn.Module, info: ArtifactInfo) -> torch.export.ExportedProgram:
    """torch.export with the batch dimension dynamic in [1, max_batch] (static when max_batch is 1)."""
    pre = info.preprocess
    module = InferenceModule(model, info.precision)
    batch = 2 if info.max_batch >= 2 else 1  # an example batch of 1 would be specialised to 1 by export
    example = torch.randn(batch, pre.channels, pre.img_size, pre.img_size)
    dynamic = {"x": {0: torch.export.Dim("batch", min=1, max=info.max_batch)}} if info.max_batch >= 2 else None
    try:
        with torch.no_grad():
            return torch.export.export(module, (example,), dynamic_shapes=dynamic)
    except Exception as e:  # export reports unsupported Python (data-dependent branches...) as many error types
        raise UserError(f"torch.export could not capture model '{info.name}': {str(e).splitlines()[0][:400]} "
                        "(models with data-dependent Python control flow need torch.cond)") from e


def build_aoti(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, **extra: str) -> None:
    """AOTInductor package with frozen weights (constants folded, conv weights prepacked)."""
    metadata = {META_KEY: info.to_json(**extra), **info.flat_metadata()}
    configs = {"freezing": True, "aot_inductor.metadata": metadata}
    with torch.no_grad():
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)


def build_onnx(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, **extra: str) -> None:
    """ONNX via the dynamo exporter from the same ExportedProgram; metadata in metadata_props."""
    try:
        import onnxscript  # noqa: F401  (the dynamo exporter needs it; fail here with an install hint)
    except ImportError:
        raise UserError("--target onnx needs onnx, onnxscript and onnxruntime: "
                        "pip install 'torchcls[export]'") from None
    program = torch.onnx.export(ep, input_names=["input"], output_names=["logits"], dynamo=True,
                                external_data=False, optimize=True, verbose=False)
    program.model.metadata_props[META_KEY] = info.to_json(**extra)
    program.model.metadata_props.update(info.flat_metadata())
    program.save(str(path), external_data=False)


BUILDERS = {"aoti": build_aoti, "onnx": build_onnx}
SUFFIX = {"aoti": ".pt2", "onnx": ".onnx", "executorch": ".pte"}

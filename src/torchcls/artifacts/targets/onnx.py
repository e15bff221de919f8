"""ONNX target: the dynamo exporter from the same ExportedProgram, run by ONNX Runtime: its CPU provider,
or its CUDAExecutionProvider (onnxruntime-gpu) for --device cuda. Metadata: the model's `metadata_props`,
key `torchcls` = the ArtifactInfo JSON. The model itself is device-neutral: its `device` metadata says
where export checked parity, and any device can load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchcls.artifacts.placement import onnx_providers
from torchcls.artifacts.targets.base import (
    META_KEY,
    ArtifactInfo,
    ExportRequest,
    LoadedArtifact,
    Plan,
    Target,
    checked_info,
    first_line,
)
from torchcls.errors import UserError
from torchcls.extras import missing_extra
from torchcls.io_files import regular_path


class OnnxArtifact(LoadedArtifact):
    """Inputs go to ONNX Runtime as host arrays (it copies them to the GPU itself): `device` stays the CPU,
    `runs_on` is where the session computes."""

    def __init__(self, path: str | Path, threads: int | None = None, device: str = "auto"):
        path = Path(path)
        try:
            import onnxruntime as ort
        except ImportError:
            raise missing_extra("export", "running .onnx artifacts", "onnxruntime") from None
        self._runs_on, providers = onnx_providers(device, ort.get_available_providers())
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        try:  # the checked regular file itself (a FIFO would block the runtime's read); our exports embed their data
            with regular_path(path, what="ONNX model") as checked:
                self.session = ort.InferenceSession(checked, opts, providers=providers)
        except UserError:
            raise
        except Exception as e:  # onnxruntime raises its own exception types for foreign or broken files
            raise UserError(f"{path} is not a loadable ONNX model ({first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target onnx`") from None
        if self._runs_on.type == "cuda" and "CUDAExecutionProvider" not in self.session.get_providers():
            # onnxruntime-gpu falls back to the CPU with only a log line when its CUDA/cuDNN libraries are missing
            raise UserError(f"{path}: ONNX Runtime could not start its CUDAExecutionProvider on {self._runs_on} "
                            "(CUDA or cuDNN libraries of the version onnxruntime-gpu was built for are missing); "
                            "install them, or use --device cpu")
        meta = self.session.get_modelmeta().custom_metadata_map
        if META_KEY not in meta:
            raise UserError(f"{path} is an ONNX model without torchcls metadata (class names, preprocessing); "
                            "export it with `torchcls export --target onnx`")
        self.info = checked_info(meta[META_KEY], path, "onnx")
        self.input_name = self.session.get_inputs()[0].name

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(out) for out in self.session.run(None, {self.input_name: x.numpy()}))


def build(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, extra: dict[str, str]) -> dict[str, Any]:
    """Metadata in metadata_props; early-exit models have a second output, `exit`."""
    outputs = ["logits", "exit"] if info.exits else ["logits"]
    program = torch.onnx.export(ep, input_names=["input"], output_names=outputs, dynamo=True,
                                external_data=False, optimize=True, verbose=False)
    program.model.metadata_props[META_KEY] = info.to_json(**extra)
    program.model.metadata_props.update(info.flat_metadata())
    program.save(str(path), external_data=False)
    return {}


def check(req: ExportRequest) -> None:
    try:
        import onnxscript  # noqa: F401  (the dynamo exporter needs it; fail here with an install hint)
    except ImportError:
        raise missing_extra("export", "--target onnx", "onnxscript") from None
    if req.precision != "fp32":
        raise UserError("--target onnx supports --precision fp32 only: ONNX Runtime's CPU provider has no bf16 "
                        "convolution kernels; use --target aoti for bf16")
    if req.device == "cuda":
        import onnxruntime as ort

        onnx_providers("cuda", ort.get_available_providers())  # refuse before any work without onnxruntime-gpu


def plan(req: ExportRequest, meta: Any) -> Plan:
    return Plan(req.precision, build)


TARGET = Target("onnx", ".onnx", OnnxArtifact, check, plan)

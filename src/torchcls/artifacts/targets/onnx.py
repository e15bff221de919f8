"""ONNX target: the dynamo exporter from the same ExportedProgram, run by ONNX Runtime: its CPU provider,
or its CUDAExecutionProvider (onnxruntime-gpu) for --device cuda. Metadata: the model's `metadata_props`,
key `torchcls` = the ArtifactInfo JSON. The model itself is device-neutral: its `device` metadata says
where export checked parity, and any device can load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchcls.artifacts.onnx_bounds import check_graph, read_model
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


class OnnxArtifact(LoadedArtifact):
    """Inputs go to ONNX Runtime as host arrays (it copies them to the GPU itself): `device` stays the CPU,
    `runs_on` is where the session computes."""

    def __init__(self, path: str | Path, threads: int | None = None, device: str = "auto"):
        path = Path(path)
        try:
            import onnx  # noqa: F401  (the graph is read and checked before ONNX Runtime sees it)
            import onnxruntime as ort
        except ImportError as e:
            raise missing_extra("export", "running .onnx artifacts", e.name) from None
        self._runs_on, providers = onnx_providers(device, ort.get_available_providers())
        data, model = read_model(path)  # one read of the checked regular file, at most MAX_ONNX_BYTES
        self.info = _metadata(model, path)
        pre = self.info.preprocess
        check_graph(model, pre.channels, pre.img_size, self.info.max_batch, 2 if self.info.exits else 1, path)
        self.input_name = model.graph.input[0].name
        del model
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        try:  # the bytes that were checked, not the file again (it could have changed since)
            self.session = ort.InferenceSession(data, opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types for foreign or broken files
            raise UserError(f"{path} is not a loadable ONNX model ({first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target onnx`") from None
        if self._runs_on.type == "cuda" and "CUDAExecutionProvider" not in self.session.get_providers():
            # onnxruntime-gpu falls back to the CPU with only a log line when its CUDA/cuDNN libraries are missing
            raise UserError(f"{path}: ONNX Runtime could not start its CUDAExecutionProvider on {self._runs_on} "
                            "(CUDA or cuDNN libraries of the version onnxruntime-gpu was built for are missing); "
                            "install them, or use --device cpu")

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(out) for out in self.session.run(None, {self.input_name: x.numpy()}))


def _metadata(model: Any, path: Path) -> ArtifactInfo:
    """The checked torchcls metadata of a parsed model (before any session exists: what it says bounds the graph)."""
    meta = [p.value for p in model.metadata_props if p.key == META_KEY]
    if len(meta) != 1:
        raise UserError(f"{path} is an ONNX model without torchcls metadata (class names, preprocessing); "
                        "export it with `torchcls export --target onnx`")
    return checked_info(meta[0], path, "onnx")


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

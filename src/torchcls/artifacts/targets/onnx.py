"""ONNX target: the dynamo exporter from the same ExportedProgram, run by ONNX Runtime (its CPU provider,
or its CUDAExecutionProvider (onnxruntime-gpu) for --device cuda) or, with `--runtime openvino`, by
OpenVINO on the CPU (fp32, or bf16 where the CPU computes it natively). Metadata: the model's
`metadata_props`, key `torchcls` = the ArtifactInfo JSON, whose `runtime` names the runtime parity was
measured on: loading uses that one. The model itself is device-neutral: its `device` metadata says
where export checked parity, and any device can load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchcls.artifacts.onnx_bounds import check_graph, read_model
from torchcls.artifacts.openvino_session import OpenVinoSession, openvino_available
from torchcls.artifacts.placement import cpu_only, onnx_providers
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

RUNTIMES = ("onnxruntime", "openvino")


class OnnxArtifact(LoadedArtifact):
    """Inputs go to ONNX Runtime as host arrays (it copies them to the GPU itself): `device` stays the CPU,
    `runs_on` is where the session computes. An artifact exported for OpenVINO runs there (CPU only)."""

    def __init__(self, path: str | Path, threads: int | None = None, device: str = "auto"):
        path = Path(path)
        try:
            import onnx  # noqa: F401  (the graph is read and checked before any runtime sees it)
        except ImportError as e:
            raise missing_extra("export", "running .onnx artifacts", e.name) from None
        data, model = read_model(path)  # one read of the checked regular file, at most MAX_ONNX_BYTES
        self.info = _metadata(model, path)
        pre = self.info.preprocess
        check_graph(model, pre.channels, pre.img_size, self.info.max_batch, 2 if self.info.exits else 1, path)
        self.input_name = model.graph.input[0].name
        del model
        threads = threads or torch.get_num_threads()
        self.runtime = self.info.runtime or "onnxruntime"
        if self.runtime == "openvino":
            self._runs_on = cpu_only(device, "ONNX artifacts exported for OpenVINO")
            self.session = OpenVinoSession(data, (pre.channels, pre.img_size, pre.img_size), self.info.max_batch,
                                           self.info.precision, threads, path)
            return
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise missing_extra("export", "running .onnx artifacts", e.name) from None
        self._runs_on, providers = onnx_providers(device, ort.get_available_providers())
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
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
        if self.runtime == "openvino":
            return self.session.run(x)
        return tuple(torch.from_numpy(out) for out in self.session.run(None, {self.input_name: x.numpy()}))


def _metadata(model: Any, path: Path) -> ArtifactInfo:
    """The checked torchcls metadata of a parsed model (before any session exists: what it says bounds the graph)."""
    meta = [p.value for p in model.metadata_props if p.key == META_KEY]
    if len(meta) != 1:
        raise UserError(f"{path} is an ONNX model without torchcls metadata (class names, preprocessing); "
                        "export it with `torchcls export --target onnx`")
    info = checked_info(meta[0], path, "onnx")
    if info.runtime not in ("", *RUNTIMES):
        raise UserError(f"{path}: its torchcls metadata names runtime {info.runtime!r}; torchcls runs ONNX models on "
                        f"{' or '.join(RUNTIMES)}: re-export it")
    return info


def build(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, extra: dict[str, str]) -> dict[str, Any]:
    """Metadata in metadata_props; early-exit models have a second output, `exit`."""
    outputs = ["logits", "exit"] if info.exits else ["logits"]
    program = torch.onnx.export(ep, input_names=["input"], output_names=outputs, dynamo=True,
                                external_data=False, optimize=True, verbose=False)
    program.model.metadata_props[META_KEY] = info.to_json(**extra)  # info.runtime: where parity is measured
    program.model.metadata_props.update(info.flat_metadata())
    program.save(str(path), external_data=False)
    return {}


def check(req: ExportRequest) -> None:
    try:
        import onnxscript  # noqa: F401  (the dynamo exporter needs it; fail here with an install hint)
    except ImportError:
        raise missing_extra("export", "--target onnx", "onnxscript") from None
    runtime = req.runtime or "onnxruntime"
    if runtime not in RUNTIMES:
        raise UserError(f"--runtime {runtime}: choose {' or '.join(RUNTIMES)}")
    if runtime == "openvino":
        if req.device != "cpu":
            raise UserError("--runtime openvino runs on the CPU: use --device cpu, or --runtime onnxruntime")
        if not openvino_available():
            raise missing_extra("export", "--runtime openvino", "openvino")
        return
    if req.precision != "fp32":
        raise UserError("--target onnx on ONNX Runtime supports --precision fp32 only: its CPU provider has no bf16 "
                        "convolution kernels; use --runtime openvino or --target aoti for bf16")
    if req.device == "cuda":
        import onnxruntime as ort

        onnx_providers("cuda", ort.get_available_providers())  # refuse before any work without onnxruntime-gpu


def plan(req: ExportRequest, meta: Any) -> Plan:
    """OpenVINO artifacts are labelled by their runtime too (export/onnx-openvino-bf16/): the same graph, other
    kernels and another parity record."""
    if req.runtime == "openvino":
        return Plan(f"openvino-{req.precision}", build)
    return Plan(req.precision, build)


TARGET = Target("onnx", ".onnx", OnnxArtifact, check, plan)

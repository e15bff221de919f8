"""An ONNX artifact run by OpenVINO instead of ONNX Runtime (`runtime = "openvino"` in its metadata).

OpenVINO reads the very bytes the ONNX checks passed (onnx_bounds: allowed operators, no external data,
bounded sizes), from a private temporary copy, since its reader takes a path: the artifact file itself
could change between the check and the read. It compiles for a batch dimension in [1, max_batch], and once
more for batch 1 alone, the latency case (static shapes: OpenVINO's static-shape run of ResNet-18 bf16 took
8.9 ms at batch 1 against 9.4 ms for the batch-range model, docs/benchmarks.md), with the
LATENCY hint (one stream using every thread: what a synchronous call wants) and the precision
the export measured parity in (bf16 only where torch's rule found it native: OpenVINO's own default).
`Core.read_model` is OpenVINO's runtime reader; its model-conversion tool (`ov.convert_model`, which
reports telemetry where the user opted in) is not used.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import threading
from pathlib import Path

import torch

from torchcls.errors import UserError
from torchcls.extras import missing_extra

PRECISIONS = ("fp32", "bf16")


def openvino_available() -> bool:
    """Without importing it (a second of start-up)."""
    return importlib.util.find_spec("openvino") is not None


class OpenVinoSession:
    """`run(x)` → every output as a float32 tensor; one inference at a time (an infer request is not
    shared between threads)."""

    def __init__(self, data: bytes, shape: tuple[int, int, int], max_batch: int, precision: str, threads: int,
                 path: Path):
        try:
            import openvino as ov
            import openvino.properties as props
            import openvino.properties.hint as hints
        except ImportError as e:
            raise missing_extra("export", "running an ONNX artifact on OpenVINO", e.name) from None
        if precision not in PRECISIONS:
            raise UserError(f"{path}: OpenVINO runs fp32 or bf16 artifacts, its metadata says {precision}")
        core = ov.Core()
        fd, name = tempfile.mkstemp(suffix=".onnx")  # 0600, removed as soon as OpenVINO has read it
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            model = core.read_model(name)
        except Exception as e:  # OpenVINO raises its own RuntimeError types for graphs it cannot read
            raise UserError(f"{path}: OpenVINO could not read this ONNX model ({str(e).splitlines()[0][:300]}); "
                            "export it again, or run it on ONNX Runtime (--runtime onnxruntime)") from None
        finally:
            Path(name).unlink(missing_ok=True)
        config = {hints.performance_mode: hints.PerformanceMode.LATENCY, props.inference_num_threads: threads,
                  hints.inference_precision: ov.Type.bf16 if precision == "bf16" else ov.Type.f32}
        self.requests = {}  # batch 1 -> its static model's request; 0 -> the batch range's
        for batch in sorted({1, 0 if max_batch > 1 else 1}, reverse=True):
            model.reshape([ov.Dimension(1, max_batch) if batch == 0 else 1, *shape])
            self.requests[batch] = core.compile_model(model, "CPU", config).create_infer_request()
        self.outputs = len(self.requests[1].model_outputs)
        self.lock = threading.Lock()

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        request = self.requests[1 if x.shape[0] == 1 else 0]
        with self.lock:
            request.infer({0: x.numpy()})
            return tuple(torch.from_numpy(request.get_output_tensor(i).data.copy()) for i in range(self.outputs))

"""The peers benchmarks/inference.py measures torchcls against, each from the same ONNX file the ORT path runs:
OpenVINO with its two default performance hints, and ONNX Runtime int8 (static QDQ quantization). Also: which
peers can run here (and why one cannot), the runtime versions a figure names, and the path `torchcls export`
builds by default on this machine.

Every runner is a callable (float32 images -> float32 logits) with a `bench_info` dict saying how it is configured;
a runner with a `timed(x, iters)` method measures itself (OpenVINO's THROUGHPUT hint keeps several requests
in flight, which one call at a time would not).
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from pathlib import Path

import torch

from torchcls.artifacts.quantize import VNNI_FLAGS

OV_HINTS = {"ov_throughput": "THROUGHPUT", "ov_latency": "LATENCY"}
# VNNI: int8 dot products in one instruction; without it ORT's int8 convolutions are slower than fp32. The
# AVX-512 forms count only while torch is not held below AVX-512 (the AVX2 stand-in: ATEN_CPU_CAPABILITY=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2), since the CPU the stand-in plays has none.
VNNI_AVX2 = ("avx_vnni",)
VNNI_AVX512 = tuple(f for f in VNNI_FLAGS if f not in VNNI_AVX2)  # the flags export's int8 rule reads, less AVX2's
ONEDNN_NO_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")  # oneDNN ISA caps without VNNI instructions
INSTALL = "pip install -e '.[export]'"  # OpenVINO, an export runtime too (--runtime openvino)


def versions() -> dict[str, str | None]:
    """torch, onnx, onnxscript, onnxruntime, openvino as installed (None: not installed)."""
    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("onnx", "onnxscript", "onnxruntime", "openvino"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _onednn_cap() -> str:
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def held_below_avx512() -> bool:
    """A CPU with AVX-512 whose torch (ATEN_CPU_CAPABILITY) or oneDNN (ONEDNN_MAX_CPU_ISA) is held below it: the
    AVX2 stand-in. A CPU without AVX-512 is a real AVX2 CPU, not a stand-in."""
    from torchcls.machine import cpu_flags

    return bool({"avx512f", "avx512_f"} & cpu_flags()) and (
        not torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")
        or (_onednn_cap() != "" and not _onednn_cap().startswith("AVX512")))


def vnni_here() -> tuple[bool, str]:
    """Whether this CPU, as torch and oneDNN are allowed to use it, has VNNI, and a line saying so."""
    from torchcls.machine import cpu_flags

    flags, capped = cpu_flags(), held_below_avx512()
    if _onednn_cap() in ONEDNN_NO_VNNI:
        return False, f"ONEDNN_MAX_CPU_ISA={_onednn_cap()} holds oneDNN below its VNNI kernels"
    have = [f for f in VNNI_AVX2 if f in flags] + ([] if capped else [f for f in VNNI_AVX512 if f in flags])
    if have:
        return True, f"CPU has {', '.join(have)}"
    held = [f for f in VNNI_AVX512 if f in flags] if capped else []
    return False, (f"CPU has {', '.join(held)} but torch/oneDNN are held below AVX-512 (AVX2 stand-in)" if held
                   else f"CPU has no VNNI ({', '.join(VNNI_FLAGS)})")


def isa_cap_note() -> str | None:
    """On the AVX2 stand-in, what the peers do with the cap (None elsewhere)."""
    if not held_below_avx512():
        return None
    return (f"AVX2 stand-in (torch CPU capability {torch.backends.cpu.get_cpu_capability()}, ONEDNN_MAX_CPU_ISA="
            f"{_onednn_cap() or 'unset'}): ONNX Runtime has no ISA cap and OpenVINO honours ONEDNN_MAX_CPU_ISA "
            "only in its oneDNN kernels (its own OV_CPU_MAX_ISA is debug builds only, openvino#36980), so the "
            "peers may use AVX-512 here that a real AVX2 CPU lacks; OpenVINO runs f32 where torch's rule finds "
            "no native bf16, as its default would on such a CPU")


def skip_reason(config: str) -> str | None:
    """Why `config` cannot be measured on this machine (None: it can)."""
    v = versions()
    if config in ("ort", "ort_int8") or config in OV_HINTS:  # every peer reads the ONNX file torchcls exports
        missing = [n for n in ("onnx", "onnxscript", "onnxruntime") if v[n] is None]
        if missing:
            return f"{', '.join(missing)} not installed: pip install -e '.[export]'"
    if config == "ort_int8":
        ok, why = vnni_here()
        return None if ok else f"int8 runs only where the CPU has VNNI: {why}"
    if config in OV_HINTS and v["openvino"] is None:
        return f"openvino not installed: {INSTALL}"
    return None


# ---------------------------------------------------------------- the default path
def default_export_request(target: str, runtime: str | None):
    """(target, ExportRequest, PrecisionChoice) that `torchcls export CHECKPOINT` builds for one of --target auto's
    candidates on this CPU, every other option at its default: the exporter's own defaults and precision
    rule, read, not restated."""
    from torchcls.artifacts.exporter import _check_request  # the exporter's auto fallback, one truth
    from torchcls.artifacts.targets import get_target
    from torchcls.artifacts.targets.base import ExportRequest
    from torchcls.options import ExportOptions as D
    from torchcls.precision.hardware import choose_precision

    tgt = get_target(target)
    choice = choose_precision(D.precision, torch.device("cpu"), kind="inference")
    req = ExportRequest(choice.precision, D.max_batch, autotune=D.autotune, runtime=runtime)
    return (tgt, *_check_request(tgt, req, choice))


# ---------------------------------------------------------------- ONNX Runtime int8
def ort_int8_runner(onnx_path: Path, workdir: Path, threads: int, calibration: torch.Tensor, note: str):
    """Static int8 quantization of the fp32 ONNX (QDQ, per-channel s8 weights, s8 activations calibrated
    MinMax on `calibration`, inputs apart from the probe; `note` says which), run on ORT's CPU provider with
    `threads`."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quant_pre_process, quantize_static

    class Calibration(CalibrationDataReader):  # the public extension point quantize_static reads from
        def __init__(self):
            data = calibration.numpy()
            self.batches = iter([{"input": data[i:i + 16]} for i in range(0, len(data), 16)])

        def get_next(self):
            return next(self.batches, None)

    prepared, quantized = workdir / "int8_pre.onnx", workdir / "int8.onnx"
    quant_pre_process(str(onnx_path), str(prepared))  # shape inference + graph optimisation, as ORT advises
    quantize_static(str(prepared), str(quantized), Calibration(), quant_format=QuantFormat.QDQ, per_channel=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(quantized), opts, providers=["CPUExecutionProvider"])

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {"input": x.numpy()})[0])

    run.bench_info = {"runtime": "onnxruntime", "precision": "int8",
                "how": f"quantize_static QDQ, per-channel s8 weights, s8 activations (MinMax, {note}), "
                       f"intra_op_num_threads={threads}", "vnni": vnni_here()[1]}
    return run


# ---------------------------------------------------------------- OpenVINO
class OpenVinoRunner:
    """The ONNX read by OpenVINO, compiled for "CPU" per batch size (static shapes, OpenVINO's fastest form)
    with PERFORMANCE_HINT `hint` and INFERENCE_NUM_THREADS `threads`; its default inference precision
    (bf16 on CPUs with native bf16) unless the AVX2 stand-in plays a CPU without it, where the CPU's
    real default would be f32. THROUGHPUT: batches > 1 go through an AsyncInferQueue of the device's
    OPTIMAL_NUMBER_OF_INFER_REQUESTS, and a batch's time is the queue's time over the batches it ran."""

    def __init__(self, onnx_path: Path, hint: str, threads: int, batches: tuple[int, ...],
                 image_shape: tuple[int, int, int]):
        import openvino as ov
        import openvino.properties as props
        import openvino.properties.hint as hints

        from torchcls.precision.hardware import cpu_bf16_here

        self.core, self.hint, self.image_shape = ov.Core(), hint, image_shape
        self.config = {hints.performance_mode: getattr(hints.PerformanceMode, hint),
                       props.inference_num_threads: threads}
        native, why = cpu_bf16_here()
        forced = self.core.get_property("CPU", hints.inference_precision) == ov.Type.bf16 and not native
        if forced:
            self.config[hints.inference_precision] = ov.Type.f32
        self.onnx_path, self.compiled, self.requests, self.queues = onnx_path, {}, {}, {}
        for b in batches:
            self._compiled(b)
        c = self.compiled[batches[-1]]
        precision = c.get_property(hints.inference_precision).get_type_name()  # bf16, f32, f16
        self.bench_info = {"runtime": "openvino", "precision": {"f32": "fp32"}.get(precision, precision),
                     "how": f"PERFORMANCE_HINT={hint}, INFERENCE_NUM_THREADS={threads}, static shapes per batch, "
                            f"NUM_STREAMS={c.get_property(props.num_streams)}, INFERENCE_PRECISION_HINT={precision}"
                            + (f" (set: {why})" if forced else " (its default)")
                            + (f", async queue of {c.get_property(props.optimal_number_of_infer_requests)} "
                               "requests for b>1" if hint == "THROUGHPUT" else "")}

    def _compiled(self, batch: int):
        if batch not in self.compiled:
            model = self.core.read_model(str(self.onnx_path))
            model.reshape([batch, *self.image_shape])
            self.compiled[batch] = c = self.core.compile_model(model, "CPU", self.config)
            self.requests[batch] = c.create_infer_request()
        return self.compiled[batch]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._compiled(x.shape[0])
        request = self.requests[x.shape[0]]
        request.infer({0: x.numpy()})
        return torch.from_numpy(request.get_output_tensor(0).data.copy())

    def timed(self, x: torch.Tensor, iters: int) -> list[float]:
        if self.hint != "THROUGHPUT" or x.shape[0] == 1:  # b1 is a latency: one request at a time
            return [_time(lambda: self(x)) for _ in range(iters)]
        import openvino as ov
        import openvino.properties as props

        c = self._compiled(x.shape[0])
        n = c.get_property(props.optimal_number_of_infer_requests)
        queue = self.queues.setdefault(x.shape[0], ov.AsyncInferQueue(c, n))
        data = x.numpy()

        def fill():
            for _ in range(n):
                queue.start_async({0: data})
            queue.wait_all()

        return [_time(fill) / n for _ in range(iters)]


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

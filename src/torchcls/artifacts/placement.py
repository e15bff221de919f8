"""Which device an artifact runs on, and the refusals when it cannot run where it is asked to.

A `.pt2` is compiled code for one device: CPU code (C++/OpenMP for this ISA) or CUDA code (cubins for one
compute capability). Its metadata says which (ArtifactInfo.device / compute_capability; artifacts from before
these keys were CPU builds), and it is read from the package before its shared library is loaded: a CUDA
package on a CPU host, a CPU package asked to run on a GPU, or a GPU of another compute capability is refused
with what is needed, never a loader crash. ONNX models are device-neutral (ONNX Runtime picks kernels at load);
ExecuTorch programs run on CPUs; eager checkpoints run anywhere.

`requested` is what the user passed: "auto" (the build device for a .pt2; a GPU when one is visible for
the others) or a device name (cpu, cuda, cuda:N).
"""

from __future__ import annotations

from pathlib import Path

import torch

from torchcls.devices import capability_of, parse_device, require_cuda, resolve_device
from torchcls.errors import UserError


def _cuda_index(device: torch.device) -> torch.device:
    """cuda → cuda:<current>, so that tensors' devices compare equal to it."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def compiled_device(built: str, capability: str, gpu: str, path: Path, requested: str) -> torch.device:
    """The device a compiled artifact built for `built` (cpu|cuda; `capability` "9.0", `gpu` a name) runs on
    when `requested`; UserError when it cannot."""
    want = parse_device(requested)
    reexport = "re-export the checkpoint with `torchcls export CHECKPOINT --target aoti --device {}`"
    if built == "cpu":
        if want != "auto" and want.type == "cuda":
            raise UserError(f"{path} was built for the CPU: it holds no CUDA code and cannot run on {want}. Run it "
                            "with --device cpu, or " + reexport.format("cuda") + " on a machine with the target GPU.")
        return torch.device("cpu")
    if built != "cuda":
        raise UserError(f"{path} was built for device '{built}', which torchcls cannot run; re-export it")
    where = f"CUDA compute capability {capability or '?'} ({gpu or 'unknown GPU'})"
    if want != "auto" and want.type == "cpu":
        raise UserError(f"{path} was built for {where}: its kernels cannot run on the CPU. Run it with --device cuda "
                        "on such a GPU, or " + reexport.format("cpu") + " for a CPU artifact")
    if not torch.cuda.is_available():
        raise UserError(f"{path} was built for {where} and needs that GPU, but this machine has no usable CUDA GPU. "
                        "Run it on such a GPU, or " + reexport.format("cpu") + " for a CPU artifact")
    device = _cuda_index(resolve_device("cuda" if want == "auto" else str(want)))
    here = capability_of(device)
    if capability and here != capability:
        raise UserError(f"{path} was built for {where}, but {device} is {torch.cuda.get_device_name(device)} with "
                        f"compute capability {here}: compiled CUDA kernels run only on the capability they were "
                        f"built for. Re-export it on this GPU (`torchcls export CHECKPOINT --target aoti --device "
                        f"{device}`)")
    return device


def portable_device(requested: str) -> torch.device:
    """Device for an artifact that can run anywhere (eager checkpoint): auto = a GPU when one is visible."""
    device = resolve_device(requested)
    return _cuda_index(device) if device.type == "cuda" else device


def cpu_only(requested: str, what: str) -> torch.device:
    """ExecuTorch programs (XNNPACK/portable kernels), OpenVINO artifacts: the CPU; asking for CUDA is refused."""
    want = parse_device(requested)
    if want != "auto" and want.type == "cuda":
        raise UserError(f"--device {want}: {what} run on the CPU; use --device cpu, "
                        "or export with --target aoti --device cuda for a GPU")
    return torch.device("cpu")


def onnx_providers(requested: str, available: list[str]) -> tuple[torch.device, list[str]]:
    """(device, ONNX Runtime providers): CUDAExecutionProvider for --device cuda (refused without it), and
    for auto when a GPU and the provider are both here; the CPU provider otherwise."""
    want = parse_device(requested)
    has_cuda_ep = "CUDAExecutionProvider" in available
    if want == "auto":
        want = torch.device("cuda") if has_cuda_ep and torch.cuda.is_available() else torch.device("cpu")
    if want.type == "cpu":
        return want, ["CPUExecutionProvider"]
    if not has_cuda_ep:
        raise UserError(f"--device {want} for an .onnx model needs ONNX Runtime's CUDAExecutionProvider, which this "
                        f"onnxruntime lacks (it has {', '.join(available) or 'none'}): pip uninstall onnxruntime && "
                        "pip install onnxruntime-gpu (matching your CUDA version), or use --device cpu")
    require_cuda(want)
    device = _cuda_index(want)
    return device, [("CUDAExecutionProvider", {"device_id": device.index}), "CPUExecutionProvider"]

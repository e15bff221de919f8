"""What this machine can do in reduced precision, with messages that name the fix, and `choose_precision`:
the one rule that turns --precision auto into what runs (training, export, predict, serve).

bf16 on a CPU pays only where the CPU computes it natively (AVX-512-bf16 or AMX): elsewhere oneDNN and
torch's kernels emulate it, and a FastNet training step ran ~12x slower than fp32 on an AVX2 AMD EPYC
(66 vs 778-832 images/s; `bench compile`: bf16 inference 9-11x slower). The rule reads the CPU's flags
and the capability torch and oneDNN were told to use (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA force it
down, which is how an AVX2-only machine is emulated on an AVX-512 one); `cpu_bf16_native` is a pure
function of those, so both cases are tested on any machine.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from torchcls.errors import UserError
from torchcls.extras import missing_extra

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (sm_90), Blackwell (sm_100+): the GPUs with FP8 tensor cores
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN ISA caps below its bf16 kernels (avx512_core_bf16 and up): bf16 convolutions and matmuls are emulated.
ONEDNN_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
EMULATED_BF16_COST = {
    "training": "measured ~12x slower than fp32 for a FastNet training step on an AVX2 AMD EPYC (66 vs ~800 "
                "images/s)",
    "inference": "measured 9-11x slower than fp32 for compiled inference on an AVX2 AMD EPYC (bench compile)",
}
_warned: set[str] = set()


@dataclass(frozen=True)
class PrecisionChoice:
    """What the user asked for (`requested`, e.g. auto), what runs (`precision`) and why."""

    requested: str
    precision: str
    reason: str
    warning: str = ""  # an explicit bf16 on a CPU that emulates it: runs, and says what it costs

    def line(self) -> str:
        head = f"precision {self.precision}" if self.requested == self.precision else \
            f"precision {self.requested} -> {self.precision}"
        return f"{head}: {self.reason}"

    def record(self) -> dict[str, str]:
        return {"requested": self.requested, "precision": self.precision, "reason": self.reason,
                "warning": self.warning}


def cpu_bf16_native(flags: Iterable[str], capability: str | None = None,
                    env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether bf16 runs natively on a CPU with these feature `flags` (cpuinfo or torch names), given torch's
    CPU `capability` (torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, DEFAULT...) and the environment
    (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA). Returns (native, reason)."""
    env = {} if env is None else env
    have = sorted(set(flags) & set(NATIVE_BF16_FLAGS))
    from torchcls.machine import simd_level

    if not have:
        return False, (f"this CPU ({simd_level(flags)}) has no avx512_bf16 or amx_bf16: bf16 would be emulated "
                       "(slower than fp32)")
    forced = env.get("ATEN_CPU_CAPABILITY", "")
    if capability is not None and not capability.upper().startswith("AVX512"):
        how = f" (ATEN_CPU_CAPABILITY={forced})" if forced else ""
        return False, (f"torch's CPU kernels are limited to {capability}{how}: bf16 would be emulated although "
                       f"the CPU has {', '.join(have)}")
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        isa = env.get(var, "").strip().upper()
        if isa in ONEDNN_BELOW_BF16:
            return False, f"{var}={isa} keeps oneDNN below its bf16 kernels: bf16 would be emulated"
    return True, f"this CPU has {' and '.join(have)}: bf16 is native"


def cpu_bf16_here() -> tuple[bool, str]:
    """`cpu_bf16_native` for this machine's CPU, torch's capability and the environment."""
    from torchcls.machine import cpu_flags

    return cpu_bf16_native(cpu_flags(), torch.backends.cpu.get_cpu_capability(), os.environ)


def choose_precision(requested: str, device: torch.device, kind: str = "training",
                     cpu: tuple[bool, str] | None = None) -> PrecisionChoice:
    """`requested` as it runs on `device`: auto becomes bf16 on a CPU with native bf16 (`cpu_bf16_native`),
    on a GPU with bf16 hardware (compute capability >= 8.0, not emulated), else fp32. Any other value runs
    as given; an explicit bf16 on a CPU without native bf16 warns once per process with the measured cost.
    `kind` (training | inference) picks the measured cost quoted; `cpu` feeds (native, reason) in tests."""
    if device.type == "cuda":
        if requested != "auto":
            return PrecisionChoice(requested, requested, "as asked")
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return PrecisionChoice(requested, "bf16", f"{describe_device(device)} has bf16 hardware")
        return PrecisionChoice(requested, "fp32", f"{describe_device(device)} has no bf16 hardware (compute "
                                                  "capability < 8.0)")
    native, why = cpu if cpu is not None else cpu_bf16_here()
    if requested == "auto":
        return PrecisionChoice(requested, "bf16" if native else "fp32", why)
    if requested == "bf16" and device.type == "cpu" and not native:
        warning = (f"--precision bf16 on this CPU runs, but {why}: {EMULATED_BF16_COST[kind]}; --precision auto "
                   "(the default) picks fp32 here")
        _warn_once(warning)
        return PrecisionChoice(requested, requested, "as asked", warning)
    return PrecisionChoice(requested, requested, "as asked")


def _warn_once(message: str) -> None:
    if message in _warned:
        return
    _warned.add(message)
    from torchcls.console import console

    console.print(f"[yellow]warning: {message}[/]", highlight=False)


@functools.cache
def cpu_int8_matmul_exact() -> bool:
    """Does this CPU's int8 GEMM (torch._int_mm, which torchao's dynamic int8 runs) give exact int32 sums?

    Asked of the kernel, not read from flags: oneDNN's int8 GEMM without VNNI (AVX2, or ONEDNN_MAX_CPU_ISA=AVX2)
    adds pairs of u8 x s8 products in 16 bits, which saturate; measured on a Xeon held to AVX2, a 32x64x48
    product was off by up to 41,235, a small ViT's logits by 29% of their range, an MLP's by 23%."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (64, 48), dtype=torch.int8, generator=g)
    return bool(torch.equal(torch._int_mm(a, b), a.int() @ b.int()))


def describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{device.type} (no CUDA GPU)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def has_fp8_hardware(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def require_fp8_hardware(device: torch.device, what: str, emulate_flag: str | None,
                         fallback: str = "--precision bf16") -> None:
    """Raise a UserError unless `device` has FP8 tensor cores."""
    if has_fp8_hardware(device):
        return
    hint = (f", or add {emulate_flag} to run torchao's FP8 emulation (checks numerics; slower, not faster)"
            if emulate_flag else "")
    raise UserError(f"{what} needs an NVIDIA GPU with compute capability >= 8.9 (L4/L40/RTX 40xx, H100/H200, "
                    f"B200); the device here is {describe_device(device)}. Use {fallback}{hint}.")


def require_bf16(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision bf16: {describe_device(device)} has no bf16 support (needs compute "
                        "capability >= 8.0); use --precision fp16 on this GPU")


def require_fp16(device: torch.device) -> None:
    if device.type != "cuda":
        native, why = cpu_bf16_here()
        instead = "--precision bf16 (or auto)" if native else f"--precision fp32 or auto ({why})"
        raise UserError("--precision fp16 needs a CUDA GPU (fp16 autocast on CPU is slow and needs loss "
                        f"scaling); use {instead} on this CPU")


def require_torchao(what: str) -> None:
    """torchao is an optional extra; say how to get it instead of an ImportError traceback."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise missing_extra("precision", what, "torchao") from None

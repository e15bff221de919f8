"""The compile policy for inference: one function, the right settings per device.

CPU: Inductor with freezing (weights become constants: BatchNorm folded, conv weights prepacked
for oneDNN). Without freezing, batch-1 ResNet-18 is *slower* than eager. Freezing is only read
from the global config (`options={"freezing": True}` is silently ignored), so this sets a
process-wide flag: compile one inference configuration per process, and do not train afterwards.
CUDA: freezing plus mode="max-autotune" (autotuned kernels and CUDA graphs, which need static shapes).

Batches are padded up to a few fixed sizes ("buckets", powers of two up to max_batch), each
compiled once with static shapes: a partial last batch reuses its bucket instead of recompiling.
Static shapes are also what CUDA graphs need, and on CPU Inductor splits a dynamic batch
dimension into ranges anyway (e.g. 2-15 and 16+ for oneDNN convolutions), so "dynamic" would not
mean one graph either.

bf16 compiles a bf16 copy of the weights behind precision.inference.CastIO (the same wrapper as
the bf16 artifacts): float32 images in, float32 logits out; the caller's model stays fp32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from torchcls.errors import UserError
from torchcls.models.parts import is_convnet
from torchcls.precision.dtypes import DTYPES
from torchcls.precision.hardware import choose_precision
from torchcls.precision.inference import CastIO

PRECISIONS = ("fp32", "bf16")


def default_buckets(max_batch: int) -> tuple[int, ...]:
    sizes = {1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}
    return tuple(sorted(sizes))


@dataclass
class CompiledClassifier:
    """Call with a float32 (N, C, H, W) batch, N ≤ max_batch, on any device; returns float32 logits on CPU."""

    compiled: nn.Module
    device: torch.device
    precision: str
    max_batch: int
    buckets: tuple[int, ...]
    channels_last: bool
    compiled_buckets: set[int] = field(default_factory=set)

    def bucket(self, n: int) -> int:
        if not 1 <= n <= self.max_batch:
            raise UserError(f"batch of {n} images: this compiled model accepts 1 to {self.max_batch}")
        return next(b for b in self.buckets if b >= n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        b = self.bucket(n)
        if b > n:  # pad with zeros to the bucket's static shape; the padding rows are dropped below
            x = torch.cat([x, x.new_zeros(b - n, *x.shape[1:])])
        x = x.to(self.device, non_blocking=True)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():  # the first call must be under no_grad for freezing to apply
            y = self.compiled(x)
        self.compiled_buckets.add(b)
        # A copy: CUDA-graph outputs are overwritten by the next replay.
        return y[:n].to("cpu", torch.float32, copy=True)

    def warm_up(self, example: torch.Tensor, batch_sizes: tuple[int, ...] | None = None) -> None:
        """Compile the buckets that `batch_sizes` (default: all buckets) fall into."""
        for n in batch_sizes or self.buckets:
            b = self.bucket(n)
            if b not in self.compiled_buckets:
                self(example[:1].expand(b, *example.shape[1:]).contiguous())


def compile_for_inference(model: nn.Module, example: torch.Tensor, device: str | torch.device = "cpu",
                          precision: str = "fp32", max_batch: int = 64,
                          buckets: tuple[int, ...] | None = None, mode: str = "auto") -> CompiledClassifier:
    """Compile `model` for inference on `device` and compile the bucket of `example`'s batch size now.

    The model is put in eval mode and moved (device, memory format) in place; for bf16 a bf16 copy of it
    is compiled behind CastIO, so the model itself stays fp32. Other buckets compile
    on first use, or ahead with `.warm_up(example)`. `mode` is torch.compile's; "auto" is this
    policy's choice per device (`torchcls bench compile` sweeps the others). `precision` auto: bf16 where the
    hardware computes it natively, else fp32 (torchcls.precision.hardware.choose_precision; `.precision` of
    the result says which); an explicit bf16 on a CPU that emulates it warns once."""
    if precision not in ("auto", *PRECISIONS):
        raise UserError(f"--precision {precision}: choose auto, fp32 or bf16")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("compile for cuda: no CUDA GPU is available on this machine; use cpu")
    precision = choose_precision(precision, device, kind="inference").precision
    buckets = tuple(sorted(buckets)) if buckets else default_buckets(max_batch)
    if buckets[-1] < max_batch:
        raise UserError(f"buckets {buckets} do not reach max_batch {max_batch}")
    torch._inductor.config.freezing = True  # global on purpose: the options= route is ignored
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(buckets) + 1)
    channels_last = is_convnet(model)
    model = model.eval().to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if precision != "fp32":
        model = CastIO(copy.deepcopy(model), DTYPES[precision])
    # dynamic=False: each bucket is its own static graph, never a dynamic one that guards on ranges.
    if mode == "auto":
        mode = "max-autotune" if device.type == "cuda" else "default"
    compiled = torch.compile(model, mode=None if mode == "default" else mode, dynamic=False)
    runner = CompiledClassifier(compiled, device, precision, max_batch, buckets, channels_last)
    runner.warm_up(example, (min(example.shape[0], max_batch),))
    return runner

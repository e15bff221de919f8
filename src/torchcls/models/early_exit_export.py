"""The export-friendly form of an early-exit model: the exit decision as `torch.cond`.

A Python `if` on a tensor breaks the graph under torch.compile and fails torch.export
(GuardOnDataDependentSymNode). Here the decision stays in the graph: after exit k, if every
sample of the batch is confident, `torch.cond` returns the answers gathered so far and the
deeper segments are not run; otherwise it runs the rest, and each sample keeps the logits of
the first exit where it was confident (torch.where). Per sample that is exactly the eager
rule, so predictions are identical; compute is skipped when the whole batch agrees (always
the case at batch 1, the usual edge/serving shape).

Pitfalls (STACK.md): Inductor needs `layout_optimization = False` for cond models with
convolutions (else wrong outputs on one branch): `inductor_safe()` sets it. XNNPACK lowering
needs `ep.run_decompositions()` first; the portable ExecuTorch flow runs cond as is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchcls.errors import UserError
from torchcls.models.early_exit import EarlyExitNet, confidence


class CondEarlyExit(nn.Module):
    """forward(x) -> (logits, exit index per sample), branching with torch.cond."""

    def __init__(self, model: EarlyExitNet):
        super().__init__()
        self.model = model.eval()
        self.threshold = model.threshold

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.model.segments[0](x)
        logits = self.model.heads[0](h)
        decided = confidence(logits) >= self.threshold
        index = torch.zeros_like(decided, dtype=torch.float32)  # float: fewer int kernels on edge runtimes
        return self._from(1, h, logits, decided, index)

    def _from(self, k: int, h, acc, decided, index):
        """Exits k.. for the samples not `decided` yet; `acc` holds the answers so far."""

        def stop(h, acc, decided, index):
            return acc.clone(), index.clone()  # cond branches may not return their inputs

        def go_on(h, acc, decided, index):
            h = self.model.segments[k](h)
            logits = self.model.heads[k](h)
            acc = torch.where(decided[:, None], acc, logits)
            index = torch.where(decided, index, torch.full_like(index, k))
            if k == self.model.num_exits - 1:
                return acc, index
            return self._from(k + 1, h, acc, decided | (confidence(logits) >= self.threshold), index)

        return torch.cond(decided.all(), stop, go_on, (h, acc, decided, index))


@contextlib.contextmanager
def inductor_safe():
    """Inductor settings under which cond models with convolutions compile correctly."""
    import torch._inductor.config as inductor_config

    old = inductor_config.layout_optimization
    inductor_config.layout_optimization = False  # else silently wrong outputs on one branch (STACK.md)
    try:
        yield
    finally:
        inductor_config.layout_optimization = old


@dataclass(frozen=True)
class InputSpec:
    """The shapes an exported artifact accepts: batch in [1, max_batch], fixed C, H, W."""

    channels: int
    img_size: int
    max_batch: int

    def check(self, x: torch.Tensor) -> None:
        c, s = self.channels, self.img_size
        if x.dim() != 4 or tuple(x.shape[1:]) != (c, s, s) or not 1 <= x.shape[0] <= self.max_batch:
            raise UserError(f"input of shape {tuple(x.shape)} is outside this early-exit artifact's declared "
                            f"shapes (N, {c}, {s}, {s}) with 1 <= N <= {self.max_batch}; resize the images "
                            "or split the batch")
        if x.dtype != torch.float32:
            raise UserError(f"input dtype {x.dtype}: this artifact takes float32 images")


def export_early_exit(model: EarlyExitNet, spec: InputSpec) -> torch.export.ExportedProgram:
    """torch.export of the cond form, batch dimension dynamic in [1, max_batch]."""
    from torch.export import Dim

    example = torch.randn(min(2, spec.max_batch), spec.channels, spec.img_size, spec.img_size)
    batch = Dim("batch", min=1, max=spec.max_batch) if spec.max_batch > 1 else None
    dynamic = {"x": {0: batch}} if batch is not None else None
    with torch.no_grad():
        return torch.export.export(CondEarlyExit(model), (example[:1] if batch is None else example,),
                                   dynamic_shapes=dynamic)


def aoti_package(ep: torch.export.ExportedProgram, path: str | Path) -> Path:
    """AOTInductor package of an exported early-exit program (layout optimization off)."""
    with inductor_safe(), torch.no_grad():
        return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(path)))


def executorch_program(ep: torch.export.ExportedProgram, path: str | Path, xnnpack: bool = False) -> Path:
    """An ExecuTorch .pte of the early-exit program: portable kernels (cond runs there as is);
    with `xnnpack`, decompose first (STACK.md), delegating what XNNPACK takes."""
    try:
        from executorch.exir import to_edge_transform_and_lower
    except ImportError:
        raise UserError("ExecuTorch export needs the 'executorch' extra: pip install 'torchcls[edge]'") from None
    partitioners = []
    if xnnpack:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        ep, partitioners = ep.run_decompositions(), [XnnpackPartitioner()]
    program = to_edge_transform_and_lower(ep, partitioner=partitioners).to_executorch()
    path = Path(path)
    path.write_bytes(program.buffer)
    return path


class CheckedRunner:
    """Runs an exported artifact (callable x -> outputs) only on inputs inside its declared shapes."""

    def __init__(self, run, spec: InputSpec):
        self.run, self.spec = run, spec

    def __call__(self, x: torch.Tensor):
        self.spec.check(x)
        return self.run(x)


def load_aoti(path: str | Path, spec: InputSpec) -> CheckedRunner:
    """An AOTI package as a callable that refuses out-of-spec inputs (AOTI itself accepts them silently)."""
    runner = torch._inductor.aoti_load_package(str(path))
    return CheckedRunner(lambda x: tuple(runner(x)), spec)


def load_executorch(path: str | Path, spec: InputSpec) -> CheckedRunner:
    """An ExecuTorch program as a callable that refuses out-of-spec inputs before the runtime sees them."""
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(Path(path)).load_method("forward")
    return CheckedRunner(lambda x: tuple(method.execute([x.contiguous()])), spec)


def load_exported(ep: torch.export.ExportedProgram, spec: InputSpec) -> CheckedRunner:
    module = ep.module()
    return CheckedRunner(lambda x: tuple(module(x)), spec)

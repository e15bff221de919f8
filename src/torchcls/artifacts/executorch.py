"""ExecuTorch: an ExportedProgram → a `.pte` program (XNNPACK-delegated or portable kernels), and the
loader that runs a `.pte` through the ExecuTorch runtime (not torch eager).

Where the metadata lives: the program carries a constant method `torchcls_metadata` that returns the
ArtifactInfo JSON as a uint8 tensor (a device app reads it with the same runtime it runs `forward`
with); the same JSON is also written beside the program as `<name>.pte.json` for apps that want
class names and preprocessing without calling into the runtime.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchcls.errors import UserError
from torchcls.artifacts.artifact import META_KEY, ArtifactInfo, LoadedArtifact, _first_line

BACKENDS = ("xnnpack", "portable")
META_METHOD = f"{META_KEY}_metadata"
# Graph plumbing, not compute: never "left to portable kernels" in a meaningful sense.
_PLUMBING = {"getitem", "sym_size", "sym_size_int", "executorch_call_delegate", "cond", "output"}
_INSTALL = "pip install 'torchcls[edge]' (executorch==1.5.1, torchao==0.18.0)"


@dataclass
class LoweringReport:
    backend: str
    delegated_ops: dict[str, int] = field(default_factory=dict)  # op → count run by the XNNPACK delegate
    portable_ops: dict[str, int] = field(default_factory=dict)  # op → count left to portable kernels
    delegated_subgraphs: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "delegated_subgraphs": self.delegated_subgraphs,
                "delegated_ops": self.delegated_ops, "non_delegated_ops": self.portable_ops, "notes": self.notes}


def _require_executorch() -> None:
    try:
        import executorch.exir  # noqa: F401
    except ImportError:
        raise UserError(f"--target executorch needs ExecuTorch: {_INSTALL}") from None


def has_cond(ep: torch.export.ExportedProgram) -> bool:
    return any(n.op == "call_function" and n.target is torch.ops.higher_order.cond
               for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes)


def lower(ep: torch.export.ExportedProgram, backend: str, metadata: str | None = None) -> tuple[bytes, LoweringReport]:
    """Lower to an ExecuTorch program; returns its bytes and which ops the delegate took.

    Ops that ExecuTorch cannot lower (no core-ATen decomposition, no out-variant kernel) raise a
    UserError naming them. torch.cond: XNNPACK lowering needs the program decomposed first, and the
    branch bodies (nested graphs) stay on portable kernels: the partitioner only takes top-level nodes.
    """
    _require_executorch()
    from executorch.exir import to_edge_transform_and_lower

    report = LoweringReport(backend)
    if backend == "xnnpack" and has_cond(ep):
        ep = ep.run_decompositions()
        report.notes.append("torch.cond: branch bodies run on portable kernels (XNNPACK delegates only ops "
                            "outside the branches)")
    partitioner = []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioner = [XnnpackPartitioner()]
    constants = {META_METHOD: torch.tensor(list(metadata.encode()), dtype=torch.uint8)} if metadata else None
    try:
        edge = to_edge_transform_and_lower(ep, partitioner=partitioner, constant_methods=constants)
        _count_ops(edge.exported_program().graph_module, report)
        program = edge.to_executorch()
    except UserError:
        raise
    except Exception as e:  # exir raises SpecViolationError, RuntimeError, KeyError... naming the op
        raise _lowering_error(e, backend) from e
    if not report.delegated_ops and backend == "xnnpack":
        report.notes.append("XNNPACK took no op: everything runs on portable kernels")
    return program.buffer, report


def _count_ops(gm: torch.fx.GraphModule, report: LoweringReport) -> None:
    """Count ops inside delegate payloads (their original graphs) and ops left in the program itself,
    including nested control-flow graphs (cond branch bodies)."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    delegated: Counter[str] = Counter()
    portable: Counter[str] = Counter()

    def ops(module: torch.fx.GraphModule) -> list[str]:
        names = (_op_name(n.target) for n in module.graph.nodes if n.op == "call_function")
        return [name for name in names if not _PLUMBING.intersection(name.split("."))]

    def walk(module: torch.fx.GraphModule) -> None:
        for child in module.children():
            if isinstance(child, LoweredBackendModule):
                report.delegated_subgraphs += 1
                delegated.update(ops(child.original_module.graph_module))
            elif isinstance(child, torch.fx.GraphModule):
                walk(child)
        portable.update(ops(module))

    walk(gm)
    report.delegated_ops = dict(sorted(delegated.items()))
    report.portable_ops = dict(sorted(portable.items()))


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    name = str(getattr(target, "_name", name)) if hasattr(target, "_schema") else name
    return name.replace("aten::", "aten.").replace("::", ".")


def _lowering_error(e: Exception, backend: str) -> UserError:
    text = str(e)
    ops = sorted(set(re.findall(r"\b(?:aten|torchcls|[a-z_]+lib|[a-z_]+)(?:::|\.)[A-Za-z_][\w]*(?:\.[\w]+)?", text)))
    ops = [o for o in ops if not o.startswith(("torch.", "executorch.", "self.", "e.g.", "i.e."))][:10]
    hint = ("try --backend portable (no XNNPACK delegate; every op must then have a portable kernel), or "
            "replace these ops in the model" if backend == "xnnpack" else
            "replace these ops in the model with core ATen ops")
    named = f"ops it cannot lower: {', '.join(ops)}; " if ops else ""
    return UserError(f"ExecuTorch ({backend}) could not lower this model: {named}{_first_line(e)}. {hint}. "
                     "No .pte was written.")


class ExecuTorchArtifact(LoadedArtifact):
    """A `.pte` program run by the ExecuTorch runtime (C++ kernels: XNNPACK delegate and/or portable)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            from executorch.runtime import Runtime
        except ImportError:
            raise UserError(f"running .pte programs needs the ExecuTorch runtime: {_INSTALL}") from None
        try:
            self.program = Runtime.get().load_program(str(path))
        except Exception as e:  # the runtime raises RuntimeError/ValueError for foreign or broken files
            raise UserError(f"{path} is not a loadable ExecuTorch program ({_first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target executorch`") from None
        if META_METHOD not in self.program.method_names:
            raise UserError(f"{path} is an ExecuTorch program without torchcls metadata (class names, "
                            "preprocessing); export it with `torchcls export --target executorch`")
        (raw,) = self.program.load_method(META_METHOD).execute([])
        self.info = ArtifactInfo.from_json(bytes(raw.tolist()).decode(), str(path))
        try:
            self.method = self.program.load_method("forward")
        except Exception as e:  # e.g. a kernel or backend missing from this runtime build
            raise UserError(f"{path}: the ExecuTorch runtime cannot load 'forward' ({_first_line(e)}); the "
                            "program needs ops or a backend this runtime lacks") from None
        self.path = path

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        try:
            (logits,) = self.method.execute([x])
        except RuntimeError as e:  # check_input ran first; this is the runtime refusing anyway
            raise UserError(f"{self.path}: the ExecuTorch runtime refused an input of shape {tuple(x.shape)} "
                            f"({_first_line(e)})") from None
        return logits

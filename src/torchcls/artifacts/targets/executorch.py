"""ExecuTorch target: an ExportedProgram → a `.pte` program (XNNPACK-delegated or portable kernels,
fp32 or int8), and the loader that runs a `.pte` through the ExecuTorch runtime (not torch eager).

Options only this target has: --quantize (none|int8), --backend (xnnpack|portable),
--calibration-images (int8). The build adds its lowering report to parity.json under "executorch":
which ops the XNNPACK delegate runs, which are left to portable kernels (named), the program size,
and for int8 the accuracy of the int8 program and of the fp32 model on the same held-out images.

Where the metadata lives: the program carries a constant method `torchcls_metadata` that returns the
ArtifactInfo JSON as a uint8 tensor (a device app reads it with the same runtime it runs `forward`
with).
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchcls.artifacts.placement import cpu_only
from torchcls.artifacts.pte_bounds import MAX_PTE_BYTES, check_input_shape, check_outputs, check_plans, read_plans
from torchcls.artifacts.targets.base import (
    MAX_BATCH,
    META_KEY,
    ArtifactInfo,
    ExportRequest,
    LoadedArtifact,
    Plan,
    Target,
    checked_info,
    first_line,
    has_cond,
)
from torchcls.errors import UserError
from torchcls.extras import missing_extra
from torchcls.io_files import read_bytes
from torchcls.models.registry import MAX_IMG_SIZE, MAX_IN_CHANS
from torchcls.noise import EXECUTORCH_CPUINFO, stderr_without

if TYPE_CHECKING:
    from torchcls.checkpoint.files import CheckpointMeta

BACKENDS = ("xnnpack", "portable")
META_METHOD = f"{META_KEY}_metadata"
# Graph plumbing, not compute: never "left to portable kernels" in a meaningful sense.
_PLUMBING = {"getitem", "sym_size", "sym_size_int", "executorch_call_delegate", "cond", "output"}


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
        raise missing_extra("edge", "--target executorch", "executorch") from None


def lower(ep: torch.export.ExportedProgram, backend: str, metadata: str | None = None) -> tuple[bytes, LoweringReport]:
    """Lower to an ExecuTorch program; returns its bytes and which ops the delegate took.

    Ops that ExecuTorch cannot lower (no core-ATen decomposition, no out-variant kernel) raise a
    UserError naming them. torch.cond: XNNPACK lowering needs the program decomposed first, and the
    branch bodies (nested graphs) stay on portable kernels: the partitioner only takes top-level nodes.
    """
    _require_executorch()
    from executorch.exir import to_edge_transform_and_lower

    report = LoweringReport(backend)
    bounds = _input_bounds(ep)
    partitioner = []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioner = [XnnpackPartitioner()]
    constants = {META_METHOD: torch.tensor(list(metadata.encode()), dtype=torch.uint8)} if metadata else None
    try:
        with _frozen_shape_ranges(ep):
            if backend == "xnnpack" and has_cond(ep):
                ep = ep.run_decompositions()
                report.notes.append("torch.cond: branch bodies run on portable kernels (XNNPACK delegates only "
                                    "ops outside the branches)")
            edge = to_edge_transform_and_lower(ep, partitioner=partitioner, constant_methods=constants)
            _count_ops(edge.exported_program().graph_module, report)
            program = edge.to_executorch()
    except UserError:
        raise
    except Exception as e:  # exir raises SpecViolationError, RuntimeError, KeyError... naming the op
        raise _lowering_error(e, backend) from e
    _check_planned_bounds(program.exported_program(), bounds)
    if not report.delegated_ops and backend == "xnnpack":
        report.notes.append("XNNPACK took no op: everything runs on portable kernels")
    return program.buffer, report


@contextlib.contextmanager
def _frozen_shape_ranges(ep: torch.export.ExportedProgram) -> Iterator[None]:
    """Lower without letting shape guards narrow the dynamic batch range.

    XNNPACK's passes re-run the fake convolution kernel, whose backend choice (oneDNN or not) asks
    "batch < 16" of the symbolic batch; with export's example batch of 2 as the hint, that guard
    narrowed the batch range from [2, max] to [2, 15], memory planning sized the input for 15 images,
    and the runtime refused every larger batch. The choice only affects strides of a fake tensor,
    never shapes, so guards are suppressed while lowering (the switch is per thread, for every shape
    environment, so a program that run_decompositions rebuilds is covered too).
    """
    with contextlib.ExitStack() as stack:
        for env in {s.node.shape_env for s in _input_sizes(ep) if isinstance(s, torch.SymInt)}:
            stack.enter_context(env.suppress_guards())
        yield


def _input_sizes(ep: torch.export.ExportedProgram) -> list[int | torch.SymInt]:
    user_inputs = set(ep.graph_signature.user_inputs)
    return [s for n in ep.graph.nodes if n.op == "placeholder" and n.name in user_inputs
            for s in getattr(n.meta.get("val"), "shape", ())]


def _input_bounds(ep: torch.export.ExportedProgram) -> list[int]:
    from executorch.exir.sym_util import eval_upper_bound

    return [eval_upper_bound(s) for s in _input_sizes(ep)]


def _check_planned_bounds(ep: torch.export.ExportedProgram, bounds: list[int]) -> None:
    """The program must hold inputs as large as the export declared (else the runtime refuses them)."""
    planned = [d for n in ep.graph.nodes if n.op == "placeholder" and n.name in set(ep.graph_signature.user_inputs)
               for d in n.meta["spec"].shape]
    if planned != bounds:
        raise UserError(f"ExecuTorch planned the input for shape {planned}, smaller than the declared bound "
                        f"{bounds}: the runtime would refuse larger batches; no .pte was written. Please report it.")


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
    return UserError(f"ExecuTorch ({backend}) could not lower this model: {named}{first_line(e)}. {hint}. "
                     "No .pte was written.")


class ExecuTorchArtifact(LoadedArtifact):
    """A `.pte` program run by the ExecuTorch runtime (C++ kernels: XNNPACK delegate and/or portable)."""

    def __init__(self, path: str | Path, device: str = "auto"):
        path = Path(path)
        self.device = cpu_only(device, "ExecuTorch programs")
        try:
            from executorch.runtime import Runtime
        except ImportError:
            raise missing_extra("edge", "running .pte programs", "executorch") from None
        data = read_bytes(path, max_bytes=MAX_PTE_BYTES, what="ExecuTorch program")  # the bytes checked are loaded
        plans = read_plans(data, path)
        if META_METHOD not in plans:
            raise UserError(f"{path} is an ExecuTorch program without torchcls metadata (class names, "
                            "preprocessing); export it with `torchcls export --target executorch`")
        # The runtime allocates the planned buffers as it loads the program: they are bounded first.
        shape = check_plans(plans, META_METHOD, (MAX_BATCH, MAX_IN_CHANS, MAX_IMG_SIZE, MAX_IMG_SIZE), path)
        try:
            self.program = Runtime.get().load_program(data)
        except Exception as e:  # the runtime raises RuntimeError/ValueError for foreign or broken files
            raise UserError(f"{path} is not a loadable ExecuTorch program ({first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target executorch`") from None
        check_outputs(self.program, META_METHOD, shape, path)
        self.info = _metadata(self.program, path)
        check_input_shape(shape, self.info, path)
        try:
            with stderr_without(EXECUTORCH_CPUINFO):  # the XNNPACK threadpool's ARM core probe (torchcls.noise)
                self.method = self.program.load_method("forward")
        except Exception as e:  # e.g. a kernel or backend missing from this runtime build
            raise UserError(f"{path}: the ExecuTorch runtime cannot load 'forward' ({first_line(e)}); the "
                            "program needs ops or a backend this runtime lacks") from None
        self.path = path

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        try:
            return tuple(self.method.execute([x]))
        except RuntimeError as e:  # check_input ran first; this is the runtime refusing anyway
            raise UserError(f"{self.path}: the ExecuTorch runtime refused an input of shape {tuple(x.shape)} "
                            f"({first_line(e)})") from None


def _metadata(program: Any, path: Path) -> ArtifactInfo:
    """The metadata method's bytes (at most 8 MiB: check_program saw its output size), checked."""
    from torchcls.checkpoint.meta_check import META_BOUNDS

    (raw,) = program.load_method(META_METHOD).execute([])
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1 or \
            raw.numel() > META_BOUNDS.max_bytes:
        raise UserError(f"{path}: its '{META_METHOD}' method does not return the metadata's bytes; re-export it "
                        "with `torchcls export --target executorch`")
    try:
        text = raw.numpy().tobytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: its torchcls metadata is not UTF-8 (byte {e.start}); re-export it") from None
    return checked_info(text, path, "executorch")


def check(req: ExportRequest) -> None:
    from torchcls.artifacts.quantize import QUANTIZE

    quantize, backend = req.quantize or "none", req.backend or "xnnpack"
    if req.device != "cpu":
        raise UserError(f"--device {req.device}: --target executorch builds programs for CPUs (XNNPACK or portable "
                        "kernels); drop --device, or use --target aoti --device cuda for a GPU artifact")
    if quantize not in QUANTIZE:
        raise UserError(f"--quantize {quantize}: choose one of {', '.join(QUANTIZE)}")
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
    if req.calibration_images is not None and quantize == "none":
        raise UserError("--calibration-images applies to --quantize int8 only")
    _require_executorch()
    if req.precision != "fp32":
        raise UserError("--target executorch takes --precision fp32 (what auto builds for it); use --quantize "
                        "int8 for a smaller, faster program")
    if quantize == "int8" and backend != "xnnpack":
        raise UserError("--quantize int8 needs --backend xnnpack: portable kernels have no quantized convolutions")
    if quantize == "int8" and req.early_exit:
        raise UserError("--quantize int8: early-exit models export to ExecuTorch in fp32 only (int8 calibration "
                        "does not reach the torch.cond branches)")


def plan(req: ExportRequest, meta: CheckpointMeta) -> Plan:
    """Gather everything that can fail cheaply (calibration images) before any lowering."""
    from torchcls.artifacts.quantize import INT8_MIN_AGREEMENT, calibration_images

    backend = req.backend or "xnnpack"
    calib = None
    if (req.quantize or "none") == "int8":
        calib = calibration_images(meta, req.calibration_images, req.data, req.root)

    def build(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, extra: dict[str, str]) -> dict[str, Any]:
        if calib is not None:
            from torchcls.artifacts.quantize import quantize_int8

            dynamic = ({0: torch.export.Dim("batch", min=1, max=info.max_batch)},) if info.max_batch >= 2 else None
            ep = quantize_int8(ep, calib, dynamic, batch=min(32, info.max_batch))
            info = replace(info, precision="int8")
        program, report = lower(ep, backend, info.to_json(backend=backend, **extra))
        path.write_bytes(program)
        out = report.to_dict() | {"program_bytes": len(program), "quantize": req.quantize or "none"}
        if calib is not None:
            out["calibration_images"] = len(calib)
        return {"executorch": out}

    if calib is None:
        return Plan("fp32", build)
    return Plan("int8", build, INT8_MIN_AGREEMENT, _finish_int8)


def _finish_int8(parity: dict[str, Any]) -> None:
    """int8 reports both accuracies on the same held-out images and the drop (in points)."""
    parity["precision"] = "int8"
    parity["int8_accuracy"] = parity["artifact_accuracy"]
    parity["fp32_accuracy"] = parity["eager_accuracy"]
    parity["accuracy_drop_pt"] = round(100 * (parity["eager_accuracy"] - parity["artifact_accuracy"]), 4)


TARGET = Target("executorch", ".pte", ExecuTorchArtifact, check, plan)

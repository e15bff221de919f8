"""`torchcls export --target executorch`: the options only the edge target has (--quantize,
--backend, --calibration-images), plugged into the shared export flow (capture → build → parity →
atomic publish in torchcls.artifacts.exporter) as one builder plus its loader.

The builder adds its lowering report to parity.json under "executorch": which ops the XNNPACK
delegate runs, which are left to portable kernels (named), the program size, and for int8 the
accuracy of the int8 program and of the fp32 model on the same held-out images.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from torchcls.errors import UserError
from torchcls.artifacts.artifact import ArtifactInfo
from torchcls.artifacts.executorch import BACKENDS, ExecuTorchArtifact, _require_executorch, lower
from torchcls.artifacts.quantize import INT8_MIN_AGREEMENT, QUANTIZE, calibration_images
from torchcls.checkpoint.files import CheckpointMeta


@dataclass
class EdgeBuild:
    """What the exporter needs from the edge target: a builder, a loader, and the precision label
    (fp32/int8) used in the default path and the parity threshold."""

    builder: Callable[..., dict[str, Any]]
    loader: type[ExecuTorchArtifact]
    label: str
    min_agreement: float | None


def check_edge_options(target: str, quantize: str | None, backend: str | None,
                       calibration: int | None) -> None:
    if target != "executorch":
        given = [f for f, v in (("--quantize", quantize), ("--backend", backend),
                                ("--calibration-images", calibration)) if v is not None and v != "none"]
        if given:
            raise UserError(f"{', '.join(given)} apply to --target executorch only (got --target {target})")
        return
    if (quantize or "none") not in QUANTIZE:
        raise UserError(f"--quantize {quantize}: choose one of {', '.join(QUANTIZE)}")
    if (backend or "xnnpack") not in BACKENDS:
        raise UserError(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
    if calibration is not None and (quantize or "none") == "none":
        raise UserError("--calibration-images applies to --quantize int8 only")


def edge_build(meta: CheckpointMeta, precision: str, quantize: str | None, backend: str | None,
               calibration: int | None, data: str | None, root: str | None) -> EdgeBuild:
    """Gather everything that can fail cheaply (the runtime, calibration images) before any lowering."""
    _require_executorch()
    quantize, backend = quantize or "none", backend or "xnnpack"
    if precision != "fp32":
        raise UserError("--target executorch takes --precision fp32 (the default); use --quantize int8 for a "
                        "smaller, faster program")
    calib = None
    if quantize == "int8":
        if backend != "xnnpack":
            raise UserError("--quantize int8 needs --backend xnnpack: portable kernels have no quantized "
                            "convolutions")
        calib = calibration_images(meta, calibration, data, root)

    def build(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, **extra: str) -> dict[str, Any]:
        if calib is not None:
            from torchcls.artifacts.quantize import quantize_int8

            dynamic = ({0: torch.export.Dim("batch", min=1, max=info.max_batch)},) if info.max_batch >= 2 else None
            ep = quantize_int8(ep, calib, dynamic, batch=min(32, info.max_batch))
            info = replace(info, precision="int8")
        program, report = lower(ep, backend, info.to_json(backend=backend, **extra))
        path.write_bytes(program)
        out = report.to_dict()
        out.update(program_bytes=len(program), quantize=quantize)
        if calib is not None:
            out["calibration_images"] = len(calib)
        return {"executorch": out}

    label = "int8" if quantize == "int8" else "fp32"
    return EdgeBuild(build, ExecuTorchArtifact, label, INT8_MIN_AGREEMENT if label == "int8" else None)


def finish_parity(parity: dict[str, Any], label: str) -> None:
    """int8 reports both accuracies on the same held-out images and the drop (in points)."""
    if label == "int8":
        parity["precision"] = "int8"
        parity["int8_accuracy"] = parity["artifact_accuracy"]
        parity["fp32_accuracy"] = parity["eager_accuracy"]
        parity["accuracy_drop_pt"] = round(100 * (parity["eager_accuracy"] - parity["artifact_accuracy"]), 4)


def describe(parity: dict[str, Any]) -> str:
    """The export report's ExecuTorch part, for the terminal."""
    et = parity["executorch"]
    lines = [f"program: {et['program_bytes'] / 1e6:.2f} MB, backend {et['backend']}, quantize {et['quantize']}, "
             f"{et['delegated_subgraphs']} delegated subgraph(s)",
             "delegated ops: " + (", ".join(f"{k}×{v}" for k, v in et["delegated_ops"].items()) or "none"),
             "left to portable kernels: " + (", ".join(f"{k}×{v}" for k, v in et["non_delegated_ops"].items())
                                             or "none")]
    if "int8_accuracy" in parity:
        lines.append(f"held-out accuracy: int8 {parity['int8_accuracy']:.4f}, fp32 {parity['fp32_accuracy']:.4f} "
                     f"(drop {parity['accuracy_drop_pt']:.2f} pt)")
    lines += [f"note: {n}" for n in et["notes"]]
    return "\n".join(lines)

"""`torchcls export`: checkpoint → verified artifact.

The artifact is built under a temporary name beside its final path, loaded back through the same
loader users get (load_artifact's classes), compared with the eager model on held-out images, and
renamed into place only when parity passes: a failed export leaves nothing at the final path.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchcls.options import ExportOptions as _D  # the defaults, declared once
from torchcls.errors import UserError
from torchcls.artifacts.artifact import AOTIArtifact, ArtifactInfo, LoadedArtifact, OnnxArtifact
from torchcls.artifacts.build import BUILDERS, DTYPES, SUFFIX, capture
from torchcls.artifacts.edge import check_edge_options, edge_build, finish_parity
from torchcls.artifacts.parity import DEFAULT_MIN_AGREEMENT, held_out_images, measure_parity
from torchcls.checkpoint.files import atomic_write, load_model, resolve_checkpoint, run_dir_of

LOADERS: dict[str, type[LoadedArtifact]] = {"aoti": AOTIArtifact, "onnx": OnnxArtifact}


@dataclass
class ExportResult:
    path: Path
    parity_path: Path
    parity: dict[str, Any]
    info: ArtifactInfo


def export(checkpoint: str | Path, target: str = _D.target, precision: str = _D.precision,
           max_batch: int = _D.max_batch, out: str | Path | None = None, min_agreement: float | None = None,
           parity_images: int = _D.parity_images,
           data: str | None = None, root: str | None = None, quantize: str | None = None,
           backend: str | None = None, calibration_images: int | None = None) -> ExportResult:
    """Export `checkpoint` (a .safetensors file or a run dir) to an AOTInductor package or ONNX model.

    Default path: <run dir>/export/<target>-<precision>/model.{pt2,onnx}; parity.json goes beside it.
    Raises UserError (and writes no artifact) when top-1 agreement with eager is below
    `min_agreement` (default 0.999 for fp32, 0.99 for bf16).
    --target executorch (a .pte program) takes `quantize` (none|int8), `backend` (xnnpack|portable)
    and `calibration_images` (int8); see torchcls.artifacts.edge.
    """
    check_edge_options(target, quantize, backend, calibration_images)
    _check_options(target, precision, max_batch, min_agreement, parity_images)
    ckpt = resolve_checkpoint(checkpoint)
    model, meta = load_model(ckpt)
    builder, loader, label = BUILDERS.get(target), LOADERS.get(target), precision
    if target == "executorch":
        edge = edge_build(meta, precision, quantize, backend, calibration_images, data, root)
        builder, loader, label = edge.builder, edge.loader, edge.label
        min_agreement = edge.min_agreement if min_agreement is None else min_agreement
    min_agreement = DEFAULT_MIN_AGREEMENT[precision] if min_agreement is None else min_agreement
    run_dir = run_dir_of(ckpt)
    path = _artifact_path(out, run_dir or ckpt.parent, target, label)
    images, labels = held_out_images(meta, parity_images, data, root)  # before compiling: fail fast

    info = ArtifactInfo(run_dir.name if run_dir else ckpt.stem, target, list(meta.classes), meta.preprocess,
                        max_batch, precision)
    extra = {"source": str(ckpt), "model": meta.spec.name, "torch": torch.__version__}
    ep = capture(copy.deepcopy(model), info)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".partial{path.suffix}")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        report = builder(ep, info, tmp, **extra)
        parity = measure_parity(model, loader(tmp), images, labels, min_agreement)
        parity.update(target=target, precision=precision, checkpoint=str(ckpt.resolve()), artifact=path.name)
        parity.update(report or {})
        finish_parity(parity, label)
        if not parity["passed"]:
            raise UserError(
                f"parity failed: the {target} {label} artifact agrees with eager on top-1 for "
                f"{parity['top1_agreement']:.4%} of {parity['n']} held-out images (needed {min_agreement:.4%}; "
                f"max |Δlogit| {parity['max_abs_diff']:.3g}). No artifact was written to {path}. "
                + ("For bf16, a lower --min-agreement may be acceptable." if precision == "bf16" else
                   "An fp32 artifact should match eager: this points to an export bug; please report it."))
        parity_path = path.parent / "parity.json"
        atomic_write(parity_path, lambda t: Path(t).write_text(json.dumps(parity, indent=2)))
        _make_readable(parity_path)
        _make_readable(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(path, parity_path, parity, info)


def _make_readable(path: Path) -> None:
    # Temp files are created 0600; an artifact is meant to be shared like any file the user writes.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _check_options(target: str, precision: str, max_batch: int, min_agreement: float | None,
                   parity_images: int) -> None:
    if target not in (*BUILDERS, "executorch"):
        raise UserError(f"--target {target}: choose one of {', '.join(BUILDERS)}, executorch")
    if precision not in DTYPES:
        raise UserError(f"--precision {precision}: choose fp32 or bf16")
    if target == "onnx" and precision != "fp32":
        raise UserError("--target onnx supports --precision fp32 only: ONNX Runtime's CPU provider has no bf16 "
                        "convolution kernels; use --target aoti for bf16")
    if not 1 <= max_batch <= 4096:
        raise UserError(f"--max-batch {max_batch}: must be between 1 and 4096")
    if min_agreement is not None and not 0.0 <= min_agreement <= 1.0:
        raise UserError(f"--min-agreement {min_agreement}: must be a fraction between 0 and 1")
    if parity_images < 1:
        raise UserError(f"--parity-images {parity_images}: parity needs at least one image")


def _artifact_path(out: str | Path | None, base: Path, target: str, precision: str) -> Path:
    suffix = SUFFIX[target]
    if out is None:
        path = base / "export" / f"{target}-{precision}" / f"model{suffix}"
    else:
        path = Path(out)
        if path.is_dir() or not path.suffix:
            path = path / f"model{suffix}"
        elif path.suffix != suffix:
            raise UserError(f"--out {out}: a --target {target} artifact must end in {suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path

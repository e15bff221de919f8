"""`torchcls export`: checkpoint → verified artifact, the same steps for every target.

capture (torch.export, batch dimension dynamic; the torch.cond form of early-exit models) → build
under a temporary name beside the final path (the target's builder) → load it back through the
loader users get → parity against the eager model on held-out images → publish (rename). A failed
export leaves nothing at the final path.

Early-exit models: parity images are picked so that every exit is taken where the held-out data
allows it, run in batches that all leave at the same exit (each torch.cond branch is exercised), and
parity.json's "early_exit" says how many images left at each exit and the agreement per exit.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.artifacts.fastest import Candidate, export_fastest
from torchcls.artifacts.out_folder import attempt_folder
from torchcls.artifacts.parity import DEFAULT_MIN_AGREEMENT, compare, held_out_images, measure_parity
from torchcls.artifacts.placement import cpu_only, portable_device
from torchcls.artifacts.targets import BY_SUFFIX, get_target
from torchcls.artifacts.targets.base import MAX_BATCH, ArtifactInfo, ExportRequest, LoadedArtifact, Plan
from torchcls.checkpoint.files import (
    CheckpointMeta,
    atomic_write,
    load_model,
    output_dir_of,
    resolve_checkpoint,
    run_dir_of,
)
from torchcls.console import console, phase
from torchcls.devices import BuildDevice
from torchcls.errors import UserError
from torchcls.events import ArtifactExported, publish
from torchcls.models.early_exit import CondEarlyExit, EarlyExitNet
from torchcls.options import ExportOptions as _D  # the defaults, declared once
from torchcls.precision.dtypes import DTYPES
from torchcls.precision.hardware import PrecisionChoice, choose_precision
from torchcls.precision.inference import CastIO
from torchcls.provenance.digest import sha256_file
from torchcls.provenance.trust import record_export
from torchcls.run_files import refuse_links_below

PARITY_CHUNK = 32
EARLY_EXIT_POOL = 4  # early-exit parity picks from this many times --parity-images held-out images


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
           backend: str | None = None, calibration_images: int | None = None, device: str = _D.device,
           autotune: bool = _D.autotune, runtime: str | None = _D.runtime) -> ExportResult:
    """Export `checkpoint` (a .safetensors file or a run dir) to an AOTInductor package (aoti), an ONNX
    model (onnx) or an ExecuTorch program (executorch); early-exit models export their torch.cond form.

    `precision` auto: bf16 where the hardware has it natively and the target builds it (aoti), else fp32
    (parity.json says why). Default path: <run dir>/export/<target>-<precision>/model.{pt2,onnx,pte}.
    Raises UserError (and writes no artifact) when top-1 agreement with eager is below
    `min_agreement` (default 0.999 for fp32, 0.99 for bf16, 0.95 for int8).
    --target executorch takes `quantize` (none|int8), `backend` (xnnpack|portable) and
    `calibration_images` (int8); see torchcls.artifacts.targets.executorch.
    `device` (cpu, cuda, cuda:N; auto = cuda when a GPU is visible): capture, compile and check parity there;
    a CUDA .pt2 runs only on GPUs of this one's compute capability, which its metadata records.
    `autotune`: aoti with Inductor max-autotune. `runtime` (onnx): onnxruntime (default) or openvino (CPU).
    `target` auto (the default): every target this machine can run is exported and checked, the fastest here is
    returned, its parity.json says why (torchcls.artifacts.fastest); an --out ending in a suffix names the target.
    """
    if target == "auto" and out is not None and Path(out).suffix and not Path(out).is_dir():
        target = _target_named_by(Path(out))  # --out model.onnx: the suffix names the target
    if target == "auto" and precision == "int8":
        target = "aoti"  # the one target that builds it
    source = _Source(checkpoint, parity_images, data, root)

    def checked(target: str, precision: str, quantize: str | None, backend: str | None,
                calibration_images: int | None, autotune: bool, runtime: str | None) -> ExportRequest:
        _check_options(target, precision, max_batch, min_agreement, parity_images, quantize, backend,
                       calibration_images, autotune, runtime)
        return ExportRequest(precision, max_batch, quantize, backend, calibration_images, data, root,
                             autotune=autotune, runtime=runtime)

    if target != "auto":
        req = checked(target, precision, quantize, backend, calibration_images, autotune, runtime)
        return _export_target(source, target, req, out, min_agreement, device)
    checked(target, precision, quantize, backend, calibration_images, autotune, runtime)
    source.ckpt  # a wrong path is one error, not one per candidate

    def one(c: Candidate) -> ExportResult:
        req = checked(c.target, c.precision or precision, None, None,
                      calibration_images if c.precision == "int8" else None, autotune and c.target == "aoti",
                      c.runtime)
        return _export_target(source, c.target, req, None if out is None else Path(out) / c.name, min_agreement,
                              device)

    winner, choice = export_fastest(one, portable_device(device), max_batch, precision)
    winner.parity["choice"] = choice
    _write_parity(winner.parity_path, winner.parity)
    return winner


class _Source:
    """The checkpoint, its model and its held-out parity images: each read when first needed (after the options
    were checked) and once, however many targets are built from them (--target auto builds every candidate)."""

    def __init__(self, checkpoint: str | Path, parity_images: int, data: str | None, root: str | None):
        self.checkpoint, self.parity_images, self.data, self.root = checkpoint, parity_images, data, root

    @cached_property
    def ckpt(self) -> Path:
        return resolve_checkpoint(self.checkpoint)

    @cached_property
    def loaded(self) -> tuple[nn.Module, CheckpointMeta]:
        return load_model(self.ckpt)

    @cached_property
    def parity_set(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The parity images, their labels, and for an early-exit model how they were picked per exit."""
        model, meta = self.loaded
        if isinstance(model, EarlyExitNet):
            return _early_exit_images(model, meta, self.parity_images, self.data, self.root)
        return (*held_out_images(meta, self.parity_images, self.data, self.root), {})


def _export_target(source: _Source, target: str, asked: ExportRequest, out: str | Path | None,
                   min_agreement: float | None, device: str) -> ExportResult:
    """One target, its options checked: `asked.precision` is the one asked for (auto, ...)."""
    tgt = get_target(target)
    # A CUDA device that is not here fails now, before any work; ExecuTorch builds for CPUs (auto = cpu).
    dev = (cpu_only(device, "--target executorch programs") if target == "executorch"
           else portable_device(device))
    choice = choose_precision(asked.precision, dev, kind="inference")  # auto: bf16 where the hardware has it
    req, choice = _check_request(tgt, replace(asked, precision=choice.precision, device=dev.type), choice)
    model, meta = source.loaded
    if isinstance(model, EarlyExitNet):
        req, choice = _check_request(tgt, replace(req, early_exit=True), choice)
    ckpt = source.ckpt
    # A bad --out, or a link on the way to it in the run dir, is refused before any work
    _artifact_path(out, output_dir_of(ckpt), tgt.suffix, target, req.precision)
    # Parity images before compiling (fail fast), read once for every attempt (auto: bf16, then fp32).
    images, labels, selection = source.parity_set
    job = _Job(tgt, target, model, meta, ckpt, dev, out, min_agreement, images, labels, selection)
    try:
        return _export_as(job, req, choice)
    except ParityFailed as failed:
        # auto never trades a working fp32 artifact for a faster one that fails its own gate.
        if choice.requested != "auto" or req.precision == "fp32":
            raise
        fallback = PrecisionChoice("auto", "fp32", f"{choice.reason}, but the {req.precision} artifact failed "
                                   f"parity ({failed.agreement:.2%} top-1 agreement, {failed.needed:.2%} needed): "
                                   "built fp32 instead")
        return _export_as(job, replace(req, precision="fp32"), fallback, failed.figures)


@dataclass
class _Job:
    """What stays the same between an export's attempts (auto: bf16, then fp32 if bf16 fails parity)."""
    tgt: Any
    target: str
    model: nn.Module
    meta: CheckpointMeta
    ckpt: Path
    dev: torch.device
    out: str | Path | None
    min_agreement: float | None
    images: torch.Tensor  # the held-out parity images and their labels, read once
    labels: torch.Tensor
    selection: dict[str, Any]  # early-exit models: how the images were picked per exit ({} otherwise)


def _export_as(job: _Job, req: ExportRequest, choice: PrecisionChoice,
               fallback_from: dict[str, Any] | None = None) -> ExportResult:
    """One attempt: build `req`, check its parity, publish it; ParityFailed otherwise, with nothing written
    (neither the artifact nor the folder this attempt made for it)."""
    precision = _announce(choice)
    plan = job.tgt.plan(req, job.meta)
    min_agreement = job.min_agreement if job.min_agreement is not None else (
        plan.min_agreement if plan.min_agreement is not None else DEFAULT_MIN_AGREEMENT[precision])
    path = _artifact_path(job.out, output_dir_of(job.ckpt), job.tgt.suffix, job.target, plan.label)
    with attempt_folder(path.parent):
        result = _build_check_publish(job, req, choice, plan, path, min_agreement, fallback_from)
    # governance, subscribed, registers it in the audit log when the checkpoint's run has lineage
    publish(ArtifactExported(path, job.ckpt, {"target": job.target, "precision": plan.label,
                                              "top1_agreement": result.parity["top1_agreement"]}, result.digest))
    return ExportResult(path, result.parity_path, result.parity, result.info)


@dataclass
class _Published:
    parity_path: Path
    parity: dict[str, Any]
    info: ArtifactInfo
    digest: str


def _build_check_publish(job: _Job, req: ExportRequest, choice: PrecisionChoice, plan: Plan, path: Path,
                         min_agreement: float, fallback_from: dict[str, Any] | None) -> _Published:
    tgt, model, meta, ckpt, dev, target = job.tgt, job.model, job.meta, job.ckpt, job.dev, job.target
    images, labels, precision = job.images, job.labels, choice.precision
    early_exit = isinstance(model, EarlyExitNet)
    run_dir = run_dir_of(ckpt)
    built = BuildDevice.of(dev)
    info = ArtifactInfo(run_dir.name if run_dir else ckpt.stem, target, list(meta.classes), meta.preprocess,
                        req.max_batch, precision, model.num_exits if early_exit else 0, built.type, built.capability,
                        built.gpu, task=meta.task, thresholds=meta.thresholds,
                        runtime=(req.runtime or "onnxruntime") if target == "onnx" else "")
    extra = {"source": str(ckpt), "model": meta.spec.name, "torch": torch.__version__}
    if early_exit:
        extra["threshold"] = str(model.threshold)
    # A .pt2 is compiled for the device its program holds; an ONNX file is device-neutral (captured on the
    # CPU, its parity checked on the requested device's execution provider).
    at = dev if target == "aoti" else torch.device("cpu")
    ep = capture(copy.deepcopy(model).to(at), graph_info(info), at)
    with _partial_file(path) as tmp:
        report, artifact, digest = _build_and_load(plan, tgt, ep, info, tmp, extra, dev)
        # The eager reference runs on the same device (early-exit models: on the CPU, where their exits are chosen).
        reference = model if early_exit or dev.type == "cpu" else OnDevice(model, dev)
        phase(f"parity on {len(images)} held-out images")
        parity = measure_parity(reference, artifact, images, labels, min_agreement)
        parity.update(target=target, precision=precision, checkpoint=str(ckpt.resolve()), artifact=path.name,
                      device=built.type, precision_requested=choice.requested, precision_reason=choice.reason)
        if built.type == "cuda":
            parity.update(compute_capability=built.capability, gpu=built.gpu)
        if info.runtime:
            parity["runtime"] = info.runtime
        parity.update(report)
        if plan.finish:
            plan.finish(parity)
        if early_exit:
            parity["early_exit"] = exit_parity(model, artifact, images, labels) | job.selection
        if fallback_from is not None:  # what auto tried first and why it was not kept
            parity["precision_fallback"] = fallback_from
        _refuse_failed(parity, target, plan, path, min_agreement)
        parity_path = path.parent / "parity.json"
        _write_parity(parity_path, parity)
        _publish(tmp, path, digest)
    return _Published(parity_path, parity, info, digest)


def _announce(choice: PrecisionChoice) -> str:
    if choice.requested == "auto":
        console.print(choice.line(), highlight=False)
    return choice.precision


def _check_request(tgt, req: ExportRequest, choice: PrecisionChoice) -> tuple[ExportRequest, PrecisionChoice]:
    """The target's check of the request. A precision auto chose that the target cannot build (onnx and
    executorch build fp32; early-exit models export in fp32) becomes fp32; an explicit one is refused."""
    try:
        tgt.check(req)
    except UserError as e:
        if choice.requested != "auto" or req.precision == "fp32":
            raise
        req = replace(req, precision="fp32")
        tgt.check(req)
        return req, PrecisionChoice("auto", "fp32", f"{choice.reason}, but this export builds fp32 only ({e})")
    return req, choice


class OnDevice(nn.Module):
    """`model` on a GPU, called with host images: the eager reference of a CUDA export's parity."""

    def __init__(self, model: nn.Module, device: torch.device):
        super().__init__()
        self.model, self.device = model.to(device), device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.to(self.device)).float().cpu()


def _build_and_load(plan: Plan, tgt, ep: torch.export.ExportedProgram, info: ArtifactInfo, tmp: Path,
                    extra: dict[str, str], dev: torch.device) -> tuple[dict[str, Any], LoadedArtifact, str]:
    """Build the artifact under its temporary name, hash it, then load it back with the user's loader.
    The digest (the one published and registered) is taken before the file is loaded: a .pt2 is native
    code, and what its loading or anything after it does to the file must not be what gets vouched for."""
    phase(f"build ({info.target} {plan.label})")
    report = plan.build(ep, info, tmp, extra)
    digest = sha256_file(tmp)
    phase("load back")
    return report, tgt.load(tmp, device=str(dev)), digest


def graph_info(info: ArtifactInfo) -> ArtifactInfo:
    """What the captured graph computes in: the artifact's precision, except for OpenVINO, which reads an fp32
    graph and computes in the artifact's precision itself (its inference precision hint), and for int8, which
    the target quantizes from the fp32 graph."""
    return replace(info, precision="fp32") if info.runtime == "openvino" or info.precision == "int8" else info


def capture(model: nn.Module, info: ArtifactInfo, device: torch.device | str = "cpu") -> torch.export.ExportedProgram:
    """torch.export of what the artifact computes (float32 normalised images → float32 logits; early-exit
    models also return the exit per image), batch dimension dynamic in [1, max_batch] (static at 1). The
    model and the example batch are on `device`: AOTInductor compiles for the device the program holds."""
    phase("capture (torch.export)")
    pre = info.preprocess
    if isinstance(model, EarlyExitNet):
        module: nn.Module = CondEarlyExit(model)  # a Python `if` on a tensor cannot be exported
    elif info.precision == "fp32":
        module = model.eval()
    else:
        module = CastIO(model, DTYPES[info.precision])
    batch = 2 if info.max_batch >= 2 else 1  # an example batch of 1 would be specialised to 1 by export
    example = torch.randn(batch, pre.channels, pre.img_size, pre.img_size, device=device)
    dynamic = {"x": {0: torch.export.Dim("batch", min=1, max=info.max_batch)}} if info.max_batch >= 2 else None
    try:
        with torch.no_grad():
            return torch.export.export(module, (example,), dynamic_shapes=dynamic)
    except Exception as e:  # export reports unsupported Python (data-dependent branches...) as many error types
        raise UserError(f"torch.export could not capture model '{info.name}': {str(e).splitlines()[0][:400]} "
                        "(models with data-dependent Python control flow need torch.cond)") from e


@torch.inference_mode()
def _eager_exits(model: EarlyExitNet, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = [model.dynamic(images[i:i + PARITY_CHUNK]) for i in range(0, len(images), PARITY_CHUNK)]
    return torch.cat([c[0] for c in chunks]).float(), torch.cat([c[1] for c in chunks])


def _early_exit_images(model: EarlyExitNet, meta: CheckpointMeta, limit: int, data: str | None,
                       root: str | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Up to `limit` held-out images with every exit represented as far as the data allows: taken in
    turn from each exit's images (at the checkpoint's threshold) of a larger held-out pool, then
    ordered by exit so that parity batches leave at one exit together."""
    pool_x, pool_y = held_out_images(meta, limit * EARLY_EXIT_POOL, data, root)
    _, exits = _eager_exits(model, pool_x)
    groups = [torch.nonzero(exits == k).flatten().tolist() for k in range(model.num_exits)]
    picks: list[int] = []
    for i in range(max(map(len, groups))):
        picks += [g[i] for g in groups if i < len(g)]
    picks = sorted(picks[:limit], key=lambda j: (int(exits[j]), j))
    selection = {"threshold": model.threshold, "held_out_pool": len(pool_x),
                 "pool_exit_counts": [len(g) for g in groups]}
    return pool_x[picks], pool_y[picks], selection


@torch.inference_mode()
def exit_parity(model: EarlyExitNet, artifact: LoadedArtifact, images: torch.Tensor,
                labels: torch.Tensor) -> dict[str, Any]:
    """Per exit: how many parity images left there (eager), the artifact's parity on them (run in
    batches that all leave at that exit) and how often the artifact chose the same exit."""
    ref_logits, ref_exits = _eager_exits(model, images)
    chunk = max(1, min(artifact.info.max_batch, PARITY_CHUNK))
    per_exit, never = [], []
    for k in range(model.num_exits):
        idx = torch.nonzero(ref_exits == k).flatten()
        entry: dict[str, Any] = {"exit": k, "images": len(idx)}
        if len(idx) == 0:
            never.append(k)
            per_exit.append(entry)
            continue
        outs = [artifact.with_exits(images[idx[i:i + chunk]]) for i in range(0, len(idx), chunk)]
        logits, exits = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        entry |= compare(ref_logits[idx], logits, labels[idx])
        entry["exit_agreement"] = (exits == k).float().mean().item()
        per_exit.append(entry)
    result: dict[str, Any] = {"exits": per_exit, "never_taken": never}
    if never:
        result["note"] = (f"exit(s) {', '.join(map(str, never))} never taken by the held-out images at threshold "
                          f"{model.threshold}: no parity figures for them")
    return result


class ParityFailed(UserError):
    """An artifact below its parity bound: nothing was published. `figures`: what was measured."""

    def __init__(self, message: str, parity: dict[str, Any], needed: float):
        super().__init__(message)
        self.agreement, self.needed = parity["top1_agreement"], needed
        self.figures = {key: parity[key] for key in ("precision", "top1_agreement", "max_abs_diff", "n")} | {
            "min_agreement": needed}


def _refuse_failed(parity: dict[str, Any], target: str, plan: Plan, path: Path, min_agreement: float) -> None:
    if parity["passed"]:
        return
    precision = parity["precision"]
    raise ParityFailed(
        f"parity failed: the {target} {plan.label} artifact agrees with eager on top-1 for "
        f"{parity['top1_agreement']:.4%} of {parity['n']} held-out images (needed {min_agreement:.4%}; "
        f"max |Δlogit| {parity['max_abs_diff']:.3g}). No artifact was written to {path}. "
        + {"bf16": "For bf16, a lower --min-agreement may be acceptable.",
           "int8": "int8 loses too much of this model's decisions: export fp32 or bf16 (--precision auto), or "
                   "calibrate on more images (--calibration-images)."}.get(
            precision, "An fp32 artifact should match eager: this points to an export bug; please report it."),
        parity, min_agreement)


@contextlib.contextmanager
def _partial_file(path: Path) -> Iterator[Path]:
    """A temporary file beside `path` (same file system, so the final rename is atomic), removed unless
    it was renamed into place."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".partial{path.suffix}")
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def _publish(tmp: Path, path: Path, digest: str) -> None:
    """Rename the file built and checked into place, if it still is what was built (`digest`)."""
    _make_readable(tmp)
    if sha256_file(tmp) != digest:
        raise UserError(f"{tmp} changed between its build and its publication: nothing was published to {path}; "
                        "export again")
    os.replace(tmp, path)
    record_export(path, digest)  # loading what this machine exported needs no flag (a .pt2 is native code)


def _write_parity(path: Path, parity: dict[str, Any]) -> None:
    atomic_write(path, lambda t: Path(t).write_text(json.dumps(parity, indent=2)))
    _make_readable(path)


def _make_readable(path: Path) -> None:
    # Temp files are created 0600; an artifact is meant to be shared like any file the user writes.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _check_options(target: str, precision: str, max_batch: int, min_agreement: float | None, parity_images: int,
                   quantize: str | None, backend: str | None, calibration: int | None, autotune: bool,
                   runtime: str | None) -> None:
    if autotune and target not in ("aoti", "auto"):
        raise UserError(f"--autotune applies to --target aoti only (got --target {target})")
    if runtime is not None and target != "onnx":
        raise UserError(f"--runtime applies to --target onnx only (got --target {target}; auto tries every runtime "
                        "installed)")
    if target != "executorch":
        given = [f for f, v in (("--quantize", quantize), ("--backend", backend)) if v is not None and v != "none"]
        if calibration is not None and not (target in ("aoti", "auto") and precision in ("int8", "auto")):
            given.append("--calibration-images")
        if given:
            raise UserError(f"{', '.join(given)} apply to --target executorch only (got --target {target}; "
                            "--calibration-images also to --target aoti --precision int8)")
    if precision not in ("auto", "fp32", "bf16", "int8"):
        raise UserError(f"--precision {precision}: choose auto, fp32, bf16 or int8")
    if precision == "int8" and target not in ("aoti", "auto"):
        raise UserError(f"--precision int8 builds an AOTInductor package (--target aoti); --target {target} "
                        + ("takes --quantize int8" if target == "executorch" else "builds fp32 or bf16"))
    if not 1 <= max_batch <= MAX_BATCH:
        raise UserError(f"--max-batch {max_batch}: must be between 1 and {MAX_BATCH}")
    if min_agreement is not None and not 0.0 <= min_agreement <= 1.0:
        raise UserError(f"--min-agreement {min_agreement}: must be a fraction between 0 and 1")
    if parity_images < 1:
        raise UserError(f"--parity-images {parity_images}: parity needs at least one image")


def _target_named_by(out: Path) -> str:
    if out.suffix not in BY_SUFFIX:
        raise UserError(f"--out {out}: an artifact ends in {', '.join(BY_SUFFIX)} (or --out names a folder)")
    return BY_SUFFIX[out.suffix].name


def _artifact_path(out: str | Path | None, base: Path, suffix: str, target: str, label: str) -> Path:
    if out is None:
        path = base / "export" / f"{target}-{label}" / f"model{suffix}"
    else:
        path = Path(out)
        if path.is_dir() or not path.suffix:
            path = path / f"model{suffix}"
        elif path.suffix != suffix:
            raise UserError(f"--out {out}: a --target {target} artifact must end in {suffix}")
    refuse_links_below(base, path)  # a received run dir's export/ -> ~/elsewhere: not written through
    return path  # its folder is made by the attempt that publishes into it (attempt_folder)

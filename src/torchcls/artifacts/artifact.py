"""Load any torchcls inference artifact behind one interface: `load_artifact(path)` → a callable
that maps a float32 NCHW *normalised* batch to float32 logits, plus `info` (class names,
preprocessing, batch bound, precision) read from the artifact itself, never from a training config.

Exported artifacts (.pt2, .onnx, .pte) are opened by their target's loader (torchcls.artifacts.targets,
where each format's metadata location is described); a `.safetensors` checkpoint or a run dir runs
eagerly from the checkpoint's own metadata (torchcls.checkpoint.files).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from torchcls.artifacts.placement import portable_device
from torchcls.artifacts.targets import BY_SUFFIX
from torchcls.artifacts.targets.base import META_KEY, ArtifactInfo, LoadedArtifact
from torchcls.devices import parse_device
from torchcls.errors import UserError
from torchcls.io_files import open_regular

__all__ = ["META_KEY", "ArtifactInfo", "EagerArtifact", "LoadedArtifact", "load_artifact"]
EAGER_MAX_BATCH = 256


class EagerArtifact(LoadedArtifact):
    """The checkpoint itself, run by PyTorch eager (needs the model code), in `precision` (auto: bf16 where the
    hardware computes it natively and bf16 agrees with fp32 on held-out images, else fp32; `.choice` says
    which, why, and whether that check was made now or taken from the cache)."""

    def __init__(self, path: str | Path, device: str = "auto", precision: str = "auto"):
        from torchcls.artifacts.eager_auto import eager_model
        from torchcls.checkpoint.files import load_model, resolve_checkpoint, run_dir_of

        self.device = portable_device(device)
        ckpt = resolve_checkpoint(path)
        model, meta = load_model(ckpt)
        # auto keeps a reduced precision only where it agrees with fp32 as an exported artifact must
        # (checked once per checkpoint content and machine: artifacts/eager_auto.py).
        self.model, self.choice = eager_model(model, meta, precision, self.device)
        run_dir = run_dir_of(ckpt)
        self.info = ArtifactInfo(run_dir.name if run_dir else ckpt.stem, "eager", list(meta.classes),
                                 meta.preprocess, EAGER_MAX_BATCH, self.choice.precision, task=meta.task,
                                 thresholds=meta.thresholds)

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.model(x),)


def load_artifact(path: str | Path, expect_sha256: str | None = None, device: str = "auto",
                  trust: bool = False, precision: str = "auto") -> LoadedArtifact:
    """Open an artifact by its suffix: .pt2 (AOTInductor), .onnx (ONNX Runtime, or OpenVINO where its metadata
    says it was exported for it), .pte (ExecuTorch),
    .safetensors or a run dir (eager PyTorch), on `device` (auto, cpu, cuda, cuda:N).

    auto: a .pt2 runs where it was built (a CUDA build needs a GPU of its compute capability); an .onnx
    model on ONNX Runtime's CUDA provider when it and a GPU are here, else the CPU; a checkpoint on a
    GPU when one is visible; a .pte on the CPU. A device the artifact cannot run on is a UserError that
    says what is needed (torchcls.artifacts.placement). Inputs may live on any device; logits come back
    float32 on the CPU. `precision` (auto, fp32, bf16) is what a checkpoint runs in (auto: bf16 where the
    hardware computes it natively); an exported artifact's precision was fixed at export: another is refused.

    A .pt2 is native code: AOTInductor loads its shared library, whose constructors run before any
    metadata is read. It loads only after a trust decision (torchcls.provenance.trust): its SHA-256
    equals `expect_sha256`, `torchcls export` published it on this machine, its registration verifies
    under the configured audit key, or `trust=True` (--trust-artifact). What is loaded is a private copy
    whose digest was checked, so the file cannot be swapped between the check and the load.
    Other artifacts are checked against `expect_sha256`, or the digest registered at export, when there is one."""
    path = Path(path)
    parse_device(device)  # a bad name is reported before anything is read
    if precision not in ("auto", "fp32", "bf16"):
        raise UserError(f"--precision {precision}: choose auto, fp32 or bf16")
    if not path.exists():
        raise UserError(f"artifact {path} does not exist")
    if path.suffix == ".pt2":  # whatever the file is: only the trust decision may let native code load
        return _as_exported(_load_native(path, expect_sha256, device, trust), precision)
    from torchcls.provenance.sidecars import check_pinned_sha256

    check_pinned_sha256(path, expect_sha256)
    if path.is_dir() or path.suffix == ".safetensors":
        return EagerArtifact(path, device, precision)
    target = BY_SUFFIX.get(path.suffix)
    if target is None:
        raise UserError(f"{path}: unknown artifact type '{path.suffix}'; expected .pt2 (AOTInductor), .onnx, "
                        ".pte (ExecuTorch), .safetensors or a run dir")
    return _as_exported(target.load(path, device=device), precision)


def _as_exported(artifact: LoadedArtifact, precision: str) -> LoadedArtifact:
    if precision not in ("auto", artifact.info.precision):
        raise UserError(f"--precision {precision}: this {artifact.info.target} artifact was exported in "
                        f"{artifact.info.precision}, which it keeps; export it again with --precision {precision}, "
                        "or leave --precision auto")
    return artifact


def _load_native(path: Path, expect_sha256: str | None, device: str, trust: bool) -> LoadedArtifact:
    from torchcls.provenance.digest import sha256_stream
    from torchcls.provenance.trust import decide

    with tempfile.TemporaryDirectory(prefix="torchcls-pt2-") as private:  # 0700: only we can swap files here
        copy = Path(private) / path.name
        # One read of the regular file `path` both hashes it and makes the private copy: what is decided on
        # is exactly what is loaded, whatever happens to `path` meanwhile.
        with open_regular(path, what=".pt2 artifact") as src, open(copy, "xb") as dst:
            digest = sha256_stream(src, copy_to=dst)
        decision = decide(path, expect_sha256, trust, digest=digest)
        # AOTInductor extracts the package to a directory of its own; the copy is not needed once loaded.
        artifact = BY_SUFFIX[".pt2"].load(copy, device=device)
    artifact.trust = decision.reason
    return artifact

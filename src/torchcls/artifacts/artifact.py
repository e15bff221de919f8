"""Load any torchcls inference artifact behind one interface: `load_artifact(path)` → a callable
that maps a float32 NCHW *normalised* batch to float32 logits, plus `info` (class names,
preprocessing, batch bound, precision) read from the artifact itself, never from a training config.

Exported artifacts (.pt2, .onnx, .pte) are opened by their target's loader (torchcls.artifacts.targets,
where each format's metadata location is described); a `.safetensors` checkpoint or a run dir runs
eagerly from the checkpoint's own metadata (torchcls.checkpoint.files).
"""

from __future__ import annotations

from pathlib import Path

import torch

from torchcls.artifacts.placement import portable_device
from torchcls.artifacts.targets import BY_SUFFIX
from torchcls.artifacts.targets.base import META_KEY, ArtifactInfo, LoadedArtifact
from torchcls.devices import parse_device
from torchcls.errors import UserError

__all__ = ["META_KEY", "ArtifactInfo", "EagerArtifact", "LoadedArtifact", "load_artifact"]
EAGER_MAX_BATCH = 256


class EagerArtifact(LoadedArtifact):
    """The checkpoint itself, run by PyTorch eager (needs the model code)."""

    def __init__(self, path: str | Path, device: str = "auto"):
        from torchcls.checkpoint.files import load_model, resolve_checkpoint, run_dir_of

        self.device = portable_device(device)
        ckpt = resolve_checkpoint(path)
        self.model, meta = load_model(ckpt)
        self.model.to(self.device)
        run_dir = run_dir_of(ckpt)
        self.info = ArtifactInfo(run_dir.name if run_dir else ckpt.stem, "eager", list(meta.classes),
                                 meta.preprocess, EAGER_MAX_BATCH, "fp32", task=meta.task, thresholds=meta.thresholds)

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.model(x),)


def load_artifact(path: str | Path, expect_sha256: str | None = None, device: str = "auto") -> LoadedArtifact:
    """Open an artifact by its suffix: .pt2 (AOTInductor), .onnx (ONNX Runtime), .pte (ExecuTorch),
    .safetensors or a run dir (eager PyTorch), on `device` (auto, cpu, cuda, cuda:N).

    auto: a .pt2 runs where it was built (a CUDA build needs a GPU of its compute capability); an .onnx
    model on ONNX Runtime's CUDA provider when it and a GPU are here, else the CPU; a checkpoint on a
    GPU when one is visible; a .pte on the CPU. A device the artifact cannot run on is a UserError that
    says what is needed (torchcls.artifacts.placement). Inputs may live on any device; logits come back
    float32 on the CPU.

    A .pt2 is native code: AOTInductor loads its shared library, whose constructors run before any
    metadata is read. The file's SHA-256 is checked first against `expect_sha256`, or, when none is
    given, against the digest governance registered for it at export; a mismatch is refused."""
    path = Path(path)
    parse_device(device)  # a bad name is reported before anything is read
    if not path.exists():
        raise UserError(f"artifact {path} does not exist")
    from torchcls.governance.artifacts import check_pinned_sha256

    check_pinned_sha256(path, expect_sha256)
    if path.is_dir() or path.suffix == ".safetensors":
        return EagerArtifact(path, device)
    target = BY_SUFFIX.get(path.suffix)
    if target is None:
        raise UserError(f"{path}: unknown artifact type '{path.suffix}'; expected .pt2 (AOTInductor), .onnx, "
                        ".pte (ExecuTorch), .safetensors or a run dir")
    return target.load(path, device=device)

"""Load any torchcls inference artifact behind one interface: `load_artifact(path)` → a callable
that maps a float32 NCHW *normalised* batch to float32 logits, plus `info` (class names,
preprocessing, batch bound, precision) read from the artifact itself, never from a training config.

Where the metadata lives (written by torchcls.artifacts):
- `.pt2` (AOTInductor package): the package's metadata (`aot_inductor.metadata`), key `torchcls`
  = the ArtifactInfo JSON, plus flat `torchcls.*` keys that the C++ runner (cpp/) reads.
- `.onnx`: the model's `metadata_props`, key `torchcls` = the same JSON.
- `.safetensors` or a run dir (eager): the checkpoint's own metadata (torchcls.checkpoint.files).
Runtimes do not enforce the batch bound (AOTInductor silently accepts larger batches), so every
input is checked here first.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from torchcls.data.loaders import Preprocess
from torchcls.errors import UserError

META_KEY = "torchcls"
FORMAT_VERSION = 1
EAGER_MAX_BATCH = 256
TARGETS = ("aoti", "onnx", "executorch", "eager")
SUFFIXES = {".pt2": "aoti", ".onnx": "onnx", ".pte": "executorch", ".safetensors": "eager"}


@dataclass
class ArtifactInfo:
    name: str
    target: str  # "aoti" | "onnx" | "executorch" | "eager"
    classes: list[str]
    preprocess: Preprocess
    max_batch: int
    precision: str

    def to_json(self, **extra: Any) -> str:
        """The metadata string embedded in artifacts; `extra` (source checkpoint, torch version...) is kept
        for people reading it and ignored when loading."""
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self), **extra})

    @classmethod
    def from_json(cls, text: str, where: str) -> ArtifactInfo:
        try:
            raw = json.loads(text)
            pre = raw["preprocess"]
            return cls(str(raw["name"]), str(raw["target"]), [str(c) for c in raw["classes"]],
                       Preprocess(int(pre["img_size"]), int(pre["channels"]), tuple(map(float, pre["mean"])),
                                  tuple(map(float, pre["std"]))), int(raw["max_batch"]), str(raw["precision"]))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{where}: its torchcls metadata is unreadable ({e!r}); re-export it with "
                            "`torchcls export`") from None

    def flat_metadata(self) -> dict[str, str]:
        """Flat string keys for consumers without a JSON parser (the C++ runner)."""
        pre = self.preprocess
        return {"torchcls.classes": "\n".join(self.classes), "torchcls.img_size": str(pre.img_size),
                "torchcls.channels": str(pre.channels), "torchcls.mean": ",".join(map(repr, pre.mean)),
                "torchcls.std": ",".join(map(repr, pre.std)), "torchcls.max_batch": str(self.max_batch),
                "torchcls.precision": self.precision}


class LoadedArtifact(ABC):
    """An artifact ready to run: `artifact(x)` with x float32 (N, C, H, W), normalised, N ≤ max_batch."""

    info: ArtifactInfo

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        with torch.inference_mode():
            return self._run(x.contiguous()).float()

    def check_input(self, x: torch.Tensor) -> None:
        pre = self.info.preprocess
        want = (pre.channels, pre.img_size, pre.img_size)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise UserError(f"{self.info.name}: input must be a float32 tensor, got {got}")
        if x.dim() != 4 or tuple(x.shape[1:]) != want:
            raise UserError(f"{self.info.name}: input must have shape (N, {want[0]}, {want[1]}, {want[2]}), got "
                            f"{tuple(x.shape)}")
        if not 1 <= x.shape[0] <= self.info.max_batch:
            raise UserError(f"{self.info.name}: batch of {x.shape[0]} images; this {self.info.target} artifact "
                            f"accepts 1 to {self.info.max_batch} (split the batch, or re-export with a larger "
                            "--max-batch)")

    @abstractmethod
    def _run(self, x: torch.Tensor) -> torch.Tensor: ...


class EagerArtifact(LoadedArtifact):
    """The checkpoint itself, run by PyTorch eager (needs the model code)."""

    def __init__(self, path: str | Path):
        from torchcls.checkpoint.files import load_model, resolve_checkpoint, run_dir_of

        ckpt = resolve_checkpoint(path)
        self.model, meta = load_model(ckpt)
        run_dir = run_dir_of(ckpt)
        self.info = ArtifactInfo(run_dir.name if run_dir else ckpt.stem, "eager", list(meta.classes),
                                 meta.preprocess, EAGER_MAX_BATCH, "fp32")

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class AOTIArtifact(LoadedArtifact):
    """An AOTInductor `.pt2` package: compiled code and frozen weights; needs torch, not the model code."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            self.runner = torch._inductor.aoti_load_package(str(path))
        except Exception as e:  # the loader raises RuntimeError or zipfile errors on foreign or broken files
            raise UserError(f"{path} is not a loadable AOTInductor package ({_first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target aoti`") from None
        meta = self.runner.get_metadata()
        if META_KEY not in meta:
            raise UserError(f"{path} is an AOTInductor package without torchcls metadata (class names, "
                            "preprocessing); export it with `torchcls export --target aoti`")
        self.info = _checked_info(meta[META_KEY], path, "aoti")

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner(x)  # the package returns the model's output structure: one tensor


class OnnxArtifact(LoadedArtifact):
    """An ONNX model run by ONNX Runtime's CPU provider."""

    def __init__(self, path: str | Path, threads: int | None = None):
        path = Path(path)
        try:
            import onnxruntime as ort
        except ImportError:
            raise UserError("running .onnx artifacts needs onnxruntime: pip install 'torchcls[export]'") from None
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for foreign or broken files
            raise UserError(f"{path} is not a loadable ONNX model ({_first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target onnx`") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if META_KEY not in meta:
            raise UserError(f"{path} is an ONNX model without torchcls metadata (class names, preprocessing); "
                            "export it with `torchcls export --target onnx`")
        self.info = _checked_info(meta[META_KEY], path, "onnx")
        self.input_name = self.session.get_inputs()[0].name

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        (logits,) = self.session.run(None, {self.input_name: x.numpy()})
        return torch.from_numpy(logits)


def load_artifact(path: str | Path) -> LoadedArtifact:
    """Open an artifact by its suffix: .pt2 (AOTInductor), .onnx (ONNX Runtime), .pte (ExecuTorch),
    .safetensors or a run dir (eager PyTorch)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"artifact {path} does not exist")
    if path.is_dir():
        return EagerArtifact(path)
    kind = SUFFIXES.get(path.suffix)
    if kind is None:
        raise UserError(f"{path}: unknown artifact type '{path.suffix}'; expected .pt2 (AOTInductor), .onnx, "
                        ".pte (ExecuTorch), .safetensors or a run dir")
    if kind == "executorch":
        return _load_executorch(path)
    return {"aoti": AOTIArtifact, "onnx": OnnxArtifact, "eager": EagerArtifact}[kind](path)


def _load_executorch(path: Path) -> LoadedArtifact:
    # Hook for the ExecuTorch exporter (a separate issue): it provides
    # torchcls.artifacts.executorch.ExecuTorchArtifact(path), a LoadedArtifact subclass.
    try:
        from torchcls.artifacts.executorch import ExecuTorchArtifact  # type: ignore[import-not-found]
    except ModuleNotFoundError as e:
        if e.name != "torchcls.artifacts.executorch":
            raise
        raise UserError(f"{path}: this torchcls has no ExecuTorch runtime support yet; use a .pt2 or .onnx "
                        "artifact") from None
    return ExecuTorchArtifact(path)


def _checked_info(text: str, path: Path, target: str) -> ArtifactInfo:
    info = ArtifactInfo.from_json(text, str(path))
    if info.target != target:
        raise UserError(f"{path}: its metadata describes a '{info.target}' artifact, but the file is a {target} "
                        "artifact; it was renamed or tampered with: re-export it")
    return info


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__

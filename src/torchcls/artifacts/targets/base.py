"""What every export target shares: the metadata embedded in each artifact (`ArtifactInfo`), the
loaded-artifact interface (`LoadedArtifact`: float32 normalised NCHW batch in, float32 logits out,
shape-checked), and the `Target` record the registry holds (suffix, options check, build plan, loader).

Runtimes do not enforce the batch bound (AOTInductor silently accepts larger batches), so every
input is checked here first. Early-exit artifacts have a second output, the exit each image left at:
`LoadedArtifact.with_exits(x)` returns both; calling the artifact returns the logits only, so predict
and serve treat them like any classifier.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError
from torchcls.models.registry import MAX_EXITS

if TYPE_CHECKING:
    from torchcls.checkpoint.files import CheckpointMeta

META_KEY = "torchcls"
FORMAT_VERSION = 1
MAX_BATCH = 4096  # the largest --max-batch an export accepts (and so any artifact's metadata may say)
MAX_FIELD = 256  # characters of a short metadata string (a name, a target, a GPU's name)


@dataclass
class ArtifactInfo:
    name: str
    target: str  # "aoti" | "onnx" | "executorch" | "eager"
    classes: list[str]
    preprocess: Preprocess
    max_batch: int
    precision: str
    exits: int = 0  # early-exit models: how many exits (the artifact also outputs the exit per image); else 0
    # Where the artifact's code was compiled for: "cpu" or "cuda" (artifacts from before this key: cpu), and
    # for CUDA the compute capability ("9.0") and GPU name: compiled CUDA kernels run on that capability only.
    device: str = "cpu"
    compute_capability: str = ""
    gpu: str = ""
    task: str = "multiclass"  # multilabel: one sigmoid per class (torchcls.tasks); else softmax
    thresholds: list[float] | None = None  # multilabel: per-label decision thresholds (None: 0.5 each)
    runtime: str = ""  # onnx: "onnxruntime" or "openvino", the runtime parity was measured on ("": onnxruntime)

    def to_json(self, **extra: Any) -> str:
        """The metadata string embedded in artifacts; `extra` (source checkpoint, torch version...) is kept
        for people reading it and ignored when loading."""
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self), **extra})

    @classmethod
    def from_json(cls, text: str, where: str) -> ArtifactInfo:
        """The metadata an artifact carries, every value checked against its bound before anything is built
        from it (the classes, the preprocessing's input size, the batch bound that sizes input buffers)."""
        from torchcls.bounded_json import load_bounded
        from torchcls.checkpoint.meta_check import META_BOUNDS, check_classes, check_preprocess, check_thresholds

        raw = load_bounded(text.encode("utf-8", "surrogatepass"), META_BOUNDS, f"{where}: torchcls metadata")
        try:
            classes = check_classes(raw["classes"], None, where)
            info = cls(_short(raw["name"]), _short(raw["target"]), classes,
                       check_preprocess(raw["preprocess"], None, where), _int(raw["max_batch"], 1, MAX_BATCH, where),
                       _short(raw["precision"]), _int(raw.get("exits", 0), 0, MAX_EXITS, where),
                       _short(raw.get("device", "cpu")), _short(raw.get("compute_capability", "")),
                       _short(raw.get("gpu", "")), task=_short(raw.get("task", "multiclass")),
                       thresholds=check_thresholds(raw.get("thresholds") or None, len(classes), where),
                       runtime=_short(raw.get("runtime", "")))
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{where}: its torchcls metadata is unreadable ({e!r}); re-export it with "
                            "`torchcls export`") from None
        return info

    def flat_metadata(self) -> dict[str, str]:
        """Flat string keys for consumers without a JSON parser (the C++ runner)."""
        pre = self.preprocess
        return {"torchcls.classes": "\n".join(self.classes), "torchcls.img_size": str(pre.img_size),
                "torchcls.channels": str(pre.channels), "torchcls.mean": ",".join(map(repr, pre.mean)),
                "torchcls.std": ",".join(map(repr, pre.std)), "torchcls.max_batch": str(self.max_batch),
                "torchcls.interpolation": pre.interpolation, "torchcls.crop_pct": repr(pre.crop_pct),
                "torchcls.precision": self.precision, "torchcls.exits": str(self.exits),
                "torchcls.device": self.device, "torchcls.compute_capability": self.compute_capability,
                "torchcls.task": self.task}


class LoadedArtifact(ABC):
    """An artifact ready to run: `artifact(x)` with x float32 (N, C, H, W), normalised, N ≤ max_batch, on
    any device; outputs come back float32 on the CPU. On a CUDA artifact the batch goes through one
    pinned host buffer (an asynchronous copy) to `device`."""

    info: ArtifactInfo
    device: torch.device = torch.device("cpu")
    trust: str = ""  # a .pt2: why it was allowed to load (torchcls.provenance.trust)
    _staging: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.outputs(x)[0]

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Class probabilities: softmax, or one sigmoid per class for a multilabel model."""
        logits = self(x)
        return logits.sigmoid() if self.info.task == "multilabel" else logits.softmax(dim=1)

    def with_exits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, index of the exit each image left at) of an early-exit artifact."""
        if not self.info.exits:
            raise UserError(f"{self.info.name}: this {self.info.target} artifact is not an early-exit model")
        logits, exits = self.outputs(x)[:2]
        return logits, exits.long()

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.check_input(x)
        with torch.inference_mode():
            return tuple(t.float().cpu() for t in self._run(self.to_device(x.contiguous())))

    @property
    def runs_on(self) -> torch.device:
        """Where the computation happens: `device`, except for ONNX Runtime's CUDA provider (host inputs)."""
        return getattr(self, "_runs_on", None) or self.device

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` on the artifact's device. CPU→CUDA goes through a pinned buffer of max_batch images, reused:
        the copy is asynchronous (DMA), and the buffer is free again once the outputs (read back by
        `outputs`, which waits for the GPU) are on the host."""
        if self.device.type != "cuda" or x.device == self.device:
            return x
        if x.device.type != "cpu":
            return x.to(self.device)
        if self._staging is None:
            self._staging = torch.empty(self.info.max_batch, *x.shape[1:], dtype=x.dtype, pin_memory=True)
        host = self._staging[:x.shape[0]]
        host.copy_(x)
        return host.to(self.device, non_blocking=True)

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
    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every output of the runtime, logits first."""


@dataclass
class ExportRequest:
    """The options of one `torchcls export` that targets look at."""

    precision: str
    max_batch: int
    quantize: str | None = None
    backend: str | None = None
    calibration_images: int | None = None
    data: str | None = None
    root: str | None = None
    early_exit: bool = False
    device: str = "cpu"  # "cpu" or "cuda": what the artifact is built for
    autotune: bool = False  # aoti: Inductor max-autotune
    runtime: str | None = None  # onnx: "onnxruntime" (None: the same) or "openvino"


# build(ep, info, path, extra metadata) writes the artifact and returns what it adds to parity.json.
Builder = Callable[[torch.export.ExportedProgram, ArtifactInfo, Path, dict[str, str]], dict[str, Any]]


@dataclass
class Plan:
    """What a target decided for one export, before anything is built."""

    label: str  # the precision in the default folder name (<target>-<label>) and in messages
    build: Builder
    min_agreement: float | None = None  # None: the exporter's default for the precision
    finish: Callable[[dict[str, Any]], None] | None = None  # adds target-specific figures to parity.json


@dataclass(frozen=True)
class Target:
    name: str
    suffix: str
    load: Callable[..., LoadedArtifact]  # load(path, device="auto")
    check: Callable[[ExportRequest], None]  # cheap option checks, before the checkpoint is read
    plan: Callable[[ExportRequest, CheckpointMeta], Plan]  # may gather inputs (calibration images) that can fail


def checked_info(text: str, path: Path, target: str) -> ArtifactInfo:
    info = ArtifactInfo.from_json(text, str(path))
    if info.target != target:
        raise UserError(f"{path}: its metadata describes a '{info.target}' artifact, but the file is a {target} "
                        "artifact; it was renamed or tampered with: re-export it")
    return info


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def has_cond(ep: torch.export.ExportedProgram) -> bool:
    """Whether the program branches with torch.cond (early-exit models)."""
    return any(n.op == "call_function" and n.target is torch.ops.higher_order.cond
               for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes)


def _short(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_FIELD:
        raise TypeError(f"expected a string of at most {MAX_FIELD} characters, got {type(value).__name__}")
    return value


def _int(value: Any, low: int, high: int, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise UserError(f"{where}: torchcls metadata holds {value!r} where an integer in [{low}, {high}] belongs")
    return value


"""Typed configuration: the single source of truth for every training option.

Each field carries its help text (and choices) in `metadata`; the CLI builds its
flags from these dataclasses, so an option is declared exactly once. A config is
loaded from TOML (sections named like the dataclass fields of `Config`), then
overridden by CLI flags, and the resolved result is written into the run dir.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from torchcls.errors import UserError


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None, flag: str | None = None) -> Any:
    """A config field with its CLI help (and optional choices / flag name)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


@dataclass
class DataConfig:
    source: str = opt("mnist-5k", "built-in data set (mnist-5k, fashion-mnist), an ImageFolder directory, "
                      "or a CSV manifest with columns path,label", flag="data")
    root: str | None = opt(None, "directory of the fashion-mnist IDX files (default: the Debian package's "
                           "/usr/share/datasets/fashion-mnist); for a CSV, the base of relative paths "
                           "(default: the CSV's folder)")
    val_fraction: float = opt(0.2, "fraction of the training data held out for validation (seeded split)")
    img_size: int | None = opt(None, "input size in pixels (default: 28 for built-in sets, 224 for image files)")
    channels: int | None = opt(None, "input channels, 1 or 3 (default: 1 for built-in sets, 3 for image files); "
                               "images are converted to match")
    augment: str = opt("light", "training augmentation", choices=("none", "light", "standard"))
    batch_size: int = opt(128, "images per training step")
    workers: int = opt(2, "DataLoader worker processes (0 = load in the main process)")
    on_bad_file: str = opt("error", "what to do with unreadable images: stop with an error, or skip them "
                           "(counted and listed in the report)", choices=("error", "skip"))


@dataclass
class ModelConfig:
    name: str = opt("smallnet", "model: 'smallnet' (built-in, for 28x28), any timm name, or a torchvision "
                    "classification name prefixed 'tv/' (e.g. tv/resnet18); random init, nothing is downloaded",
                    flag="model")
    drop_rate: float = opt(0.0, "dropout before the classifier")


@dataclass
class OptimConfig:
    optimizer: str = opt("adamw", "optimizer", choices=("adamw", "sgd"))
    lr: float = opt(3e-3, "peak learning rate (reached after warm-up, then cosine decay to 0)")
    weight_decay: float = opt(0.05, "decoupled weight decay (not applied to norms and biases)")
    momentum: float = opt(0.9, "SGD momentum (Nesterov)")
    warmup_epochs: float = opt(0.5, "linear warm-up length in epochs")
    label_smoothing: float = opt(0.1, "label smoothing of the cross-entropy loss")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0 = off)")


@dataclass
class TrainConfig:
    epochs: int = opt(5, "training epochs")
    seed: int = opt(0, "seed for init, data split, data order and augmentation")
    precision: str = opt("fp32", "training precision: fp32, or bf16 autocast (CPU and GPU)",
                         choices=("fp32", "bf16"))
    channels_last: bool = opt(False, "use channels_last memory format (faster convolutions on CPU and GPU)")
    compile: bool = opt(False, "torch.compile the model for training (reports graph breaks)")
    parallel: str = opt("none", "parallelism across processes", choices=("none",))
    device: str = opt("auto", "device: auto, cpu, cuda, cuda:N")
    threads: int = opt(0, "intra-op CPU threads (0 = torch default)")
    save_every: int = opt(0, "also checkpoint every N steps (0 = at epoch ends only)")
    tensorboard: bool = opt(False, "also log scalars to TensorBoard (needs the 'tensorboard' package)")
    progress: bool = opt(True, "show a progress bar")
    memory_report: bool = opt(False, "write memory.json: on CUDA the caching allocator's stats per step (allocated "
                              "vs reserved, fragmentation, alloc retries, OOMs) with advice; on CPU the profiler's "
                              "memory events over steps 3-5 and peak RSS")
    memory_snapshot: bool = opt(False, "also write memory_snapshot.pickle for https://pytorch.org/memory_viz "
                                "(CUDA only; implies --memory-report)")


@dataclass
class RunConfig:
    name: str | None = opt(None, "run name: the run dir is OUT_DIR/NAME (default: <model>-<data>-<time>)")
    out_dir: str = opt("runs", "parent directory of run dirs")
    resume: bool = opt(False, "continue the run in OUT_DIR/NAME from its last checkpoint")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], origin: str = "config") -> Config:
        cfg = cls()
        for section, values in raw.items():
            if section not in SECTIONS:
                raise UserError(f"{origin}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise UserError(f"{origin}: [{section}] must be a table of options")
            for key, value in values.items():
                set_option(cfg, section, key, value, origin)
        return cfg

    def save_toml(self, path: Path) -> None:
        # TOML has no null: unset optional values are simply omitted.
        clean = {s: {k: v for k, v in vals.items() if v is not None} for s, vals in self.to_dict().items()}
        path.write_text(tomli_w.dumps(clean))


SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig, "run": RunConfig}


def load_toml(path: str | Path) -> Config:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    return Config.from_dict(raw, origin=str(path))


def field_type(f: dataclasses.Field) -> type:
    """The concrete type of a field, with `X | None` reduced to X."""
    hints = typing.get_type_hints(_owner_of(f))
    t = hints[f.name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def _owner_of(f: dataclasses.Field) -> type:
    for cls in SECTIONS.values():
        if any(g is f for g in dataclasses.fields(cls)):
            return cls
    raise KeyError(f.name)


def set_option(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    """Set cfg.<section>.<key> = value with type and choice checks."""
    sub = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(sub)}
    if key not in fields:
        raise UserError(f"{origin}: unknown option '{key}' in [{section}]; known: {', '.join(fields)}")
    f = fields[key]
    t = field_type(f)
    if value is not None:
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, t) or (t is int and isinstance(value, bool)):
            raise UserError(f"{origin}: [{section}] {key} must be {t.__name__}, got {value!r}")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise UserError(f"{origin}: [{section}] {key} must be one of {', '.join(choices)}, got {value!r}")
    setattr(sub, key, value)

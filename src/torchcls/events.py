"""What the core announces, and to whom: the trainer's and the exporter's events, delivered in order.

The core (training, artifacts, evaluation) never imports the consumers that act on a run (governance,
the report): it publishes an event and whoever subscribed acts on it. Delivery is synchronous, in this
process, in the order of subscription; a subscriber's exception propagates to the publisher, so a
subscriber can stop a run (governance refuses a run at `RunStarted` before any data is read, as it
always has). `torchcls.consumers` subscribes governance and the report when torchcls is imported, so
every caller, the CLI and the Python API alike, gets the same audit records and report files.

A governed run also changes what training reads and runs (hooked copies of the files, hooks on the
tensors and the model, the lineage every checkpoint carries): the subscriber that governs the run sets
`RunStarted.guard` to an object with the `RunGuard` methods; unclaimed, the run is `Unguarded`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar


class RunGuard(Protocol):
    """What the trainer asks of whoever governs its run (governance/run.py's Governance)."""

    data_config: Any  # the DataConfig the run reads (a governed run may read hooked copies of the files)
    lineage: dict[str, Any] | None  # what every checkpoint carries in its metadata; None: no lineage
    has_model_hooks: bool

    def install_data(self, data: Any) -> None: ...

    def install_model(self, model: Any) -> Any: ...


@dataclass
class Unguarded:
    """The run nobody governs: the data as configured, the model as built, no lineage."""

    data_config: Any
    lineage: dict[str, Any] | None = None
    has_model_hooks: bool = False

    def install_data(self, data: Any) -> None:
        return None

    def install_model(self, model: Any) -> Any:
        return model


@dataclass
class RunStarted:
    """`train(cfg)`, on every rank, before any data is read; a subscriber refuses the run by raising."""

    cfg: Any  # torchcls.config.Config
    run_path: Path
    guard: RunGuard | None = None  # set by the subscriber that governs the run


@dataclass
class CheckpointSaved:
    """The trainer saved its last weights and training state (`path`: the weights file)."""

    run_path: Path
    path: Path
    step: int


@dataclass
class RunFinished:
    """The last epoch is done and its checkpoints are written; `is_main`: this is rank 0 (or the only rank)."""

    cfg: Any
    run_path: Path
    result: Any  # torchcls.training.trainer.TrainResult
    is_main: bool
    guard: RunGuard | None = None


@dataclass
class ArtifactExported:
    """`export` published `path`, built from `checkpoint` and checked; `sha256`: its digest at the build."""

    path: Path
    checkpoint: Path
    details: dict[str, Any]
    sha256: str


@dataclass
class EvaluationWritten:
    """`evaluate` wrote eval.json (`result`) into `out_dir`; `classes`: the model's class names."""

    out_dir: Path
    result: dict[str, Any]
    classes: list[str] = field(default_factory=list)


E = TypeVar("E")
_subscribers: dict[type, list[Callable[[Any], None]]] = {}


def subscribe(kind: type[E], fn: Callable[[E], None]) -> Callable[[], None]:
    """Call `fn(event)` for every event of type `kind` published from now on, after the earlier
    subscribers; returns the function that unsubscribes it."""
    _subscribers.setdefault(kind, []).append(fn)

    def unsubscribe() -> None:
        if fn in _subscribers.get(kind, []):
            _subscribers[kind].remove(fn)

    return unsubscribe


def publish(event: Any) -> None:
    """Deliver `event` to its type's subscribers, in order; the first exception stops it and propagates."""
    for fn in list(_subscribers.get(type(event), ())):
        fn(event)

"""The package's layers (pyproject.toml [tool.importlinter], docs/architecture.md "Layers"), and the event
bus through which the core reaches the consumers above it without importing them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchcls import events
from torchcls.events import RunFinished, RunStarted, Unguarded

REPO = Path(__file__).resolve().parents[1]


def test_the_import_linter_contract_is_kept():
    """Every import, at module level or inside a function (grimp counts both), runs down the layers."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports is missing: install the test extra (pip install -e '.[test]')"
    done = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " 0 broken" in done.stdout


def test_the_contract_catches_an_upward_import_inside_a_function(tmp_path: Path):
    """The checker is not fooled by an import moved into a function: a made-up package whose bottom layer
    imports its top one inside a function breaks a layers contract of the same form."""
    pkg = tmp_path / "layered"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("from layered import bottom\n")
    (pkg / "bottom.py").write_text("def f():\n    from layered import top\n    return top\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_package = layered\n\n[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        "layers =\n    layered.top\n    layered.bottom\n")
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    done = subprocess.run([lint, "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "layered.bottom is not allowed to import layered.top" in done.stdout


@pytest.fixture
def bus(monkeypatch):
    """A bus with only the test's subscribers (the consumers' are set aside: they would act on a made-up run)."""
    monkeypatch.setattr(events, "_subscribers", {})
    return events.subscribe


def test_events_are_delivered_in_order_of_subscription(bus):
    heard: list[tuple[str, str]] = []
    bus(RunFinished, lambda e: heard.append(("first", e.run_path.name)))
    bus(RunFinished, lambda e: heard.append(("second", e.run_path.name)))
    bus(RunStarted, lambda e: heard.append(("started", e.run_path.name)))
    events.publish(RunFinished(None, Path("runs/a"), None, True))
    events.publish(RunFinished(None, Path("runs/b"), None, True))
    assert heard == [("first", "a"), ("second", "a"), ("first", "b"), ("second", "b")]


def test_a_subscribers_exception_stops_delivery_and_reaches_the_publisher(bus):
    """How governance refuses a run: its RunStarted subscriber raises, and the trainer's publish raises it."""
    later: list[str] = []

    def refuse(event: RunStarted) -> None:
        raise PermissionError(f"refused {event.run_path}")

    bus(RunStarted, refuse)
    bus(RunStarted, lambda e: later.append("ran"))
    with pytest.raises(PermissionError, match="refused runs/x"):
        events.publish(RunStarted(None, Path("runs/x")))
    assert later == []


def test_unsubscribe_and_the_unguarded_run(bus):
    heard: list[int] = []
    stop = bus(RunFinished, lambda e: heard.append(1))
    stop()
    stop()  # twice is harmless
    events.publish(RunFinished(None, Path("r"), None, True))
    assert heard == []
    guard = Unguarded(data_config="data")
    model = object()
    assert guard.install_model(model) is model and guard.lineage is None and not guard.has_model_hooks


def test_the_consumers_are_connected_once_on_import():
    """`import torchcls` subscribes governance and the report; a second connect adds nothing."""
    import torchcls.consumers as consumers

    before = {k: list(v) for k, v in events._subscribers.items()}
    consumers.connect()
    assert {k: list(v) for k, v in events._subscribers.items()} == before
    assert consumers._govern_run in before[RunStarted]
    finished = before[RunFinished]
    assert finished.index(consumers._record_run) < finished.index(consumers._report_run)  # governance, then report

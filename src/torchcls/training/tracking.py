"""--tracking mlflow: the run's params, metrics, report and final checkpoint in an MLflow store.

`open_tracker` runs on rank 0 before the first step and refuses a store it cannot reach (a
UserError naming --tracking-uri, in seconds), so a typo never costs a training run. A Tracker
mirrors every metrics.jsonl record (numeric fields, MLflow step = the global step), logs the
report, metrics.jsonl, config.toml and the best checkpoint as artifacts at the end, and ends the
MLflow run FINISHED, FAILED (an exception) or KILLED (an interrupt). The MLflow run id is kept
in the run dir's tracking.json, so --resume continues the same MLflow run.

Stores: a server URL (http[s]://...), sqlite:///FILE, or a folder, which holds a SQLite store
(FOLDER/mlflow.db) and the artifacts (FOLDER/mlruns/): MLflow 3 refuses its file store
(./mlruns metadata) unless MLFLOW_ALLOW_FILE_STORE=true, and recommends SQLite. The default is
$MLFLOW_TRACKING_URI, else the current directory: ./mlflow.db and ./mlruns/, MLflow's own layout,
so `mlflow ui` started there shows the runs.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from typing_extensions import TypedDict

from torchcls import run_files
from torchcls.bounded_json import JsonBounds, NotJson
from torchcls.config import Config
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.extras import missing_extra
from torchcls.made_dirs import MadeDir, make_dirs, remove_made
from torchcls.run_files import write_text_atomic
from torchcls.training.rundir import read_checked
from torchcls.typed_json import SchemaMismatch

TRACKING_FILE = "tracking.json"  # in the run dir: the store and MLflow run id that --resume continues
# tracking.json: {uri, experiment_id, run_id}
TRACKING_RECORD = JsonBounds(max_bytes=64 << 10, max_values=64, max_depth=2, max_str=8192)
ARTIFACTS = ("report.html", "metrics.jsonl", "config.toml", "pretrained.json", "skipped_files.json")
OPEN_TIMEOUT_S = "5"  # per request while the store is checked; retries off, so a dead server fails in seconds
_LIVE: dict[str, Tracker] = {}  # run id -> its tracker in this process (an interrupted run resumed in-process)


def open_tracker(cfg: Config, run_dir: Path) -> Tracker | None:
    """The run's tracker (None for --tracking none). Call on rank 0 only, once the run dir exists."""
    if cfg.train.tracking == "none":
        return None
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise missing_extra("tracking", "--tracking mlflow", "mlflow", "run with --tracking none") from None
    if not cfg.train.tracking_experiment.strip():
        raise UserError("--tracking-experiment is empty: name the MLflow experiment (default: torchcls)")
    given = cfg.train.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "."
    uri, artifacts = resolve_uri(given)
    where = f"--tracking-uri {given}" if cfg.train.tracking_uri else (
        f"MLFLOW_TRACKING_URI={given} (no --tracking-uri given)" if given != "." else
        "the default store in the current folder (no --tracking-uri given)")
    created = _make_store_folder(artifacts, where)
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):  # "creating tables" chatter of a new DB
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with _fail_fast():
            client = MlflowClient(uri)
            experiment_id = _experiment(client, cfg.train.tracking_experiment, artifacts)
            tracker = Tracker(client, uri, run_dir, *_run_for(client, uri, experiment_id, cfg, Path(run_dir)))
    except UserError:
        raise
    except Exception as e:  # mlflow wraps HTTP, SQL and file errors alike; the first line says which
        if created is not None:
            remove_made(created)  # nothing written half: the store folder this process made
        raise UserError(f"{where}: cannot open the MLflow store {uri} ({_reason(e)}); start the server "
                        "or fix the URI (a server URL, sqlite:///FILE or a folder), or run with --tracking none") \
            from None
    tracker.log_params(cfg)
    console.print(f"tracking: MLflow run {tracker.run_id} in experiment '{cfg.train.tracking_experiment}' at {uri}")
    return tracker


def _reason(e: Exception) -> str:
    """The cause in a few words: the OS error inside mlflow's wrapped HTTP/SQL message when there is one."""
    text = str(e).strip()
    errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if errno:
        return errno.group(1).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def resolve_uri(given: str) -> tuple[str, Path | None]:
    """(tracking URI, artifact root for new experiments): a local SQLite store keeps its artifacts in
    mlruns/ beside the database file; other stores (servers, file:) decide for themselves."""
    scheme = urlparse(given).scheme
    if len(scheme) > 1:  # a URI (one letter is a Windows drive)
        if scheme == "sqlite" and given.startswith("sqlite:///") and given != "sqlite:///:memory:":
            db = Path(given[len("sqlite:///"):]).expanduser().resolve()
            return f"sqlite:///{db}", db.parent / "mlruns"
        return given, None
    folder = Path(given).expanduser().resolve()
    return f"sqlite:///{folder / 'mlflow.db'}", folder / "mlruns"


def _make_store_folder(artifacts: Path | None, where: str) -> MadeDir | None:
    """Create the folder of a local SQLite store; returns the top folder created (None: all existed)."""
    if artifacts is None:
        return None
    folder = artifacts.parent
    try:
        return make_dirs(folder)
    except OSError as e:
        raise UserError(f"{where}: cannot create the folder {folder} of the MLflow store "
                        f"({e.strerror or e}); choose a writable place, or run with --tracking none") from None


@contextmanager
def _fail_fast():
    """While the store is checked: one try per request with a short timeout (user settings win)."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", OPEN_TIMEOUT_S)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def _experiment(client, name: str, artifacts: Path | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is None:
        location = str(artifacts / re.sub(r"[^\w.-]", "_", name)) if artifacts is not None else None
        return client.create_experiment(name, artifact_location=location)
    if exp.lifecycle_stage != "active":
        raise UserError(f"--tracking-experiment {name}: the experiment is deleted in the MLflow store; restore it "
                        "(mlflow experiments restore) or choose another name")
    return exp.experiment_id


def _run_for(client, uri: str, experiment_id: str, cfg: Config, run_dir: Path) -> tuple[str, bool]:
    """(MLflow run id, resumed): --resume continues the run recorded in tracking.json when the store has it."""
    saved = _read_tracking_file(run_dir) if cfg.run.resume else {}
    if saved.get("uri") == uri and saved.get("run_id"):
        run = _get_run(client, saved["run_id"])
        if run is not None and run.info.lifecycle_stage == "active":
            return run.info.run_id, True
        console.print(f"[yellow]tracking: MLflow run {saved['run_id']} of {run_dir / TRACKING_FILE} is gone from "
                      f"{uri}; logging the resumed run as a new MLflow run[/]")
    from torchcls.version import __version__

    tags = {"torchcls.version": __version__, "torchcls.run_dir": str(run_dir.resolve())}
    run = client.create_run(experiment_id, run_name=run_dir.name, tags=tags)
    write_text_atomic(run_dir / TRACKING_FILE, json.dumps({"uri": uri, "experiment_id": experiment_id,
                                                          "run_id": run.info.run_id}, indent=2))
    return run.info.run_id, False


class TrackingRecord(TypedDict):
    """tracking.json: the MLflow run a resume continues."""
    uri: str
    experiment_id: str
    run_id: str


def _read_tracking_file(run_dir: Path) -> dict[str, Any]:
    """tracking.json, or {} where it is absent, unreadable, not JSON or not of `TrackingRecord`'s shape: it only
    names the MLflow run to continue, and a resume without it logs to a new MLflow run (said in one line)."""
    path = run_dir / TRACKING_FILE
    try:  # (past its bounds or a link: a UserError, as for every record of a run dir)
        return read_checked(path, TRACKING_RECORD, TrackingRecord, "tracking record")
    except (OSError, NotJson):
        return {}
    except SchemaMismatch as e:
        console.print(f"[yellow]tracking: {e}; logging the resumed run as a new MLflow run[/]", highlight=False)
        return {}


def _get_run(client, run_id: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:
        return None


def flatten(cfg: Config) -> dict[str, str]:
    """Every option as "section.key" -> its value as text (unset options left out, as in config.toml)."""
    return {f"{section}.{key}": str(value) for section, values in cfg.to_dict().items()
            for key, value in values.items() if value is not None}


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics.jsonl record, named as there ("step" and "epoch" records) or
    "<kind>/<field>" for other kinds."""
    kind = record.get("kind", "")
    prefix = "" if kind in ("step", "epoch") else f"{kind}/"
    return {prefix + k: float(v) for k, v in record.items()
            if k not in ("kind", "epoch", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """One MLflow run of one torchcls run (rank 0). Logging errors after the start warn once and stop
    the tracking, never the training: metrics.jsonl keeps every record."""

    def __init__(self, client, uri: str, run_dir: Path, run_id: str, resumed: bool) -> None:
        self.client, self.uri, self.run_dir, self.run_id, self.resumed = client, uri, Path(run_dir), run_id, resumed
        self.ended = self.broken = False
        self.reopened = not resumed  # a resumed run turns RUNNING again at its first record
        if (earlier := _LIVE.get(run_id)) is not None:  # interrupted, resumed in this process: this one ends it
            earlier.ended = True
            atexit.unregister(earlier._end_at_exit)
        _LIVE[run_id] = self
        atexit.register(self._end_at_exit)

    def log_params(self, cfg: Config) -> None:
        """All options; on resume only the new ones (MLflow params are immutable) and each changed one as
        a tag "resume.changed.<option>" = "before -> now"."""
        from mlflow.entities import Param, RunTag

        params = flatten(cfg)
        old = self.client.get_run(self.run_id).data.params if self.resumed else {}
        new = [Param(k, v) for k, v in params.items() if k not in old]
        tags = [RunTag(f"resume.changed.{k}", f"{old[k]} -> {v}")
                for k, v in params.items() if k in old and old[k] != v]
        self._call(lambda: [self.client.log_batch(self.run_id, params=new[i:i + 100]) for i in range(0, len(new), 100)])
        if tags:
            self._call(lambda: self.client.log_batch(self.run_id, tags=tags))

    def log(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record as MLflow metrics at the record's global step."""
        from mlflow.entities import Metric

        if not self.reopened:
            self.reopened = self._call(lambda: self.client.update_run(self.run_id, status="RUNNING"))
        now, step = int(time.time() * 1000), int(record.get("step", 0))
        metrics = [Metric(k, v, now, step) for k, v in metrics_of(record).items()]
        if metrics:
            self._call(lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def finish(self, result) -> None:
        """After the report is written: artifacts (the run's files and its best checkpoint), status FINISHED."""
        for name in ARTIFACTS:
            if run_files.is_file(self.run_dir / name):  # (a link would upload whatever it points at)
                self._call(lambda n=name: self.client.log_artifact(self.run_id, str(self.run_dir / n)))
        # Never through a link: a resumed received run dir's best.safetensors, never rewritten when its recorded
        # best_top1 stays unbeaten, could be a link to any file of the user's (~/.ssh/id_ed25519)
        ckpt = Path(result.best_checkpoint)
        if run_files.is_file(ckpt):
            self._call(lambda: self.client.log_artifact(self.run_id, str(ckpt), artifact_path="checkpoints"))
        self._end("FINISHED")

    def close(self, step: int) -> None:
        """From the trainer's close: with an exception in flight the run ends FAILED (KILLED for an
        interrupt). A fresh run that failed before its first step is deleted, as train() removes its run
        dir. Without an exception the run stays open for finish(), or ends KILLED at exit (Ctrl-C)."""
        exc = sys.exc_info()[1]
        if exc is None or self.ended:
            return
        if not self.resumed and step == 0 and not isinstance(exc, KeyboardInterrupt):
            self._call(lambda: self.client.delete_run(self.run_id))
        self._end("KILLED" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "FAILED")

    def _end_at_exit(self) -> None:
        if not self.ended and self.reopened:  # a resumed run that never restarted keeps its old status
            self._end("KILLED")

    def _end(self, status: str) -> None:
        self.ended = True
        atexit.unregister(self._end_at_exit)
        if _LIVE.get(self.run_id) is self:
            del _LIVE[self.run_id]
        self._call(lambda: self.client.set_terminated(self.run_id, status))

    def _call(self, fn) -> bool:
        if self.broken:
            return False
        try:
            fn()
            return True
        except Exception as e:  # the store went away mid-run: say so once, keep training
            self.broken = True
            console.print(f"[yellow]tracking: MLflow store {self.uri} failed ({str(e).splitlines()[0][:200]}); "
                          f"tracking stops here, metrics.jsonl in {self.run_dir} has every record[/]")
            return False

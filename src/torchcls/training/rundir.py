"""The run directory: runs/<name>/ with config.toml, metrics.jsonl, checkpoints/, plots, report."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchcls.checkpoint.checkpointer import Checkpointer
from torchcls.checkpoint.files import CHECKPOINTS, LAST_DCP, LAST_STATE
from torchcls.config import Config
from torchcls.errors import UserError

# Written into a run dir this job created: only such a dir may be removed again (after a failed
# start, or by an elastic restart of the same torchrun job). A dir that held anything before, a
# user's own files included, is never deleted.
CREATED_BY = ".created-by.json"


def job_id() -> str:
    """The same for every attempt of one torchrun job (torchrun's run id), else this process."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getpid()}"


def created_by_this_job(path: Path) -> bool:
    try:
        return json.loads((path / CREATED_BY).read_text()).get("job") == job_id()
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class RunDir:
    path: Path

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @classmethod
    def prepare(cls, cfg: Config) -> RunDir:
        name = cfg.run.name or default_name(cfg)
        cfg.run.name = name
        path = Path(cfg.run.out_dir) / name
        checkpointer = Checkpointer(path / CHECKPOINTS)
        checkpointer.recover()  # a crash between the two renames of a sharded commit left no last.dcp/
        if cfg.run.resume and not checkpointer.has_state():
            raise UserError(f"--resume: {path} has no {CHECKPOINTS}/{LAST_STATE} (or {LAST_DCP}/) to continue "
                            "from; check --name and --out-dir")
        if not cfg.run.resume and path.exists() and any(path.iterdir()):
            raise UserError(f"run dir {path} already exists: pass --resume to continue it, "
                            "or choose another --name")
        fresh = not path.exists() or not any(path.iterdir())
        path.mkdir(parents=True, exist_ok=True)
        if fresh:
            (path / CREATED_BY).write_text(json.dumps({"job": job_id()}))
        run = cls(path)
        run.checkpoints.mkdir(exist_ok=True)
        if not cfg.run.resume:
            run.metrics_file.write_text("")
        return run

    def log(self, record: dict[str, Any]) -> None:
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def discard_failed_start(self) -> bool:
        """After a start that failed before any checkpoint: remove the dir if this job created it,
        so that the same command can simply be run again. Returns whether it was removed."""
        if not created_by_this_job(self.path) or Checkpointer(self.checkpoints).has_state():
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        return True

    def truncate_metrics(self, after_step: int) -> None:
        """On resume, drop records logged after the checkpoint so the log reads like one run."""
        kept = [line for line in read_metrics(self.path) if line.get("step", 0) <= after_step]
        self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in kept))


def default_name(cfg: Config) -> str:
    return f"{cfg.model.name.replace('/', '-')}-{Path(cfg.data.source).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""The run directory: runs/<name>/ with config.toml, metrics.jsonl, checkpoints/, plots, report."""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typing_extensions import NotRequired, TypedDict

from torchcls.bounded_json import JsonBounds, NotJson, load_bounded
from torchcls.checkpoint.checkpointer import Checkpointer
from torchcls.checkpoint.files import CHECKPOINTS, LAST_DCP, LAST_STATE, atomic_write
from torchcls.config import Config
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.io_errors import WRITE_ERRNOS, WriteError, os_error_of
from torchcls.io_files import SMALL_JSON_BYTES, open_regular, read_bytes, read_text
from torchcls.made_dirs import MadeDir, make_dir, move_aside, remove_made
from torchcls.run_files import append_text, refuse_link, sub_dir, write_text_atomic
from torchcls.typed_json import NonNegative, check

NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # errors only a write can meet

# Written into a run dir this job started in. It lets an elastic restart of the same torchrun job
# resume the dir (refuse less); it never allows removing anything: whoever can write into a dir can
# write this file too. Only what this very process created (made_dirs.MadeDir, in memory) is removed.
CREATED_BY = ".created-by.json"
MARKER_BYTES = 4096  # a marker is one short JSON object
MARKER = JsonBounds(max_bytes=MARKER_BYTES, max_values=64, max_depth=4, max_str=1024)  # {"job", "pid", "host"...}


def job_id() -> str:
    """This process's job when nothing better is known: torchrun's run id, else this process. Under
    torchrun the session refines it (training/distributed.py): the run id alone is not unique (every
    multi-node job without --rdzv-id is "none")."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getpid()}"


def created_by(path: Path, job: str) -> bool:
    """Whether the run dir `path` was created by the job `job` (its marker names it)."""
    try:
        marker = read_text(path / CREATED_BY, max_bytes=MARKER_BYTES, what="run dir marker")
        return load_bounded(marker, MARKER, str(path / CREATED_BY)).get("job") == job
    except (OSError, ValueError, AttributeError, UserError):  # (a FIFO or a huge file names no job)
        return False


@dataclass
class RunDir:
    path: Path
    job: str | None = None  # the job that prepared it (None: this process's, job_id())
    made: MadeDir | None = field(default=None, repr=False)  # the dir, when this process created it

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @classmethod
    def prepare(cls, cfg: Config, job: str | None = None) -> RunDir:
        """Create (or, with --resume, check) the run dir; a dir it creates is marked as `job`'s."""
        name = cfg.run.name or default_name(cfg)
        cfg.run.name = name
        path = Path(cfg.run.out_dir) / name
        # (a link there would take the checkpoints elsewhere: refused before anything in it is read or renamed)
        checkpointer = Checkpointer(refuse_link(path / CHECKPOINTS, "the checkpoints folder"))
        checkpointer.recover()  # a crash between the two renames of a sharded commit left no last.dcp/
        if cfg.run.resume and not checkpointer.has_state():
            raise UserError(f"--resume: {path} has no {CHECKPOINTS}/{LAST_STATE} (or {LAST_DCP}/) to continue "
                            "from; check --name and --out-dir")
        if not cfg.run.resume and path.exists() and any(path.iterdir()):
            raise UserError(f"run dir {path} already exists: pass --resume to continue it, "
                            "or choose another --name")
        fresh = not path.exists() or not any(path.iterdir())
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            made = make_dir(path)
        except FileExistsError:  # an empty dir (or --resume): used, but not this process's to remove
            made = None
        if fresh:
            write_text_atomic(path / CREATED_BY, json.dumps({"job": job or job_id()}))
        run = cls(path, job, made)
        sub_dir(run.checkpoints, "the checkpoints folder")
        if not cfg.run.resume:
            write_text_atomic(run.metrics_file, "")
        return run

    def log(self, record: dict[str, Any]) -> None:
        """Append `record` to metrics.jsonl: never through a link (O_NOFOLLOW), never into a FIFO."""
        append_text(self.metrics_file, json.dumps(record) + "\n", "the metrics log")

    def discard_failed_start(self) -> bool:
        """After a start that failed before any checkpoint, make way for the same command to simply be run
        again: remove the dir if this process created it (and the name still leads to that dir), else
        move a dir it started in aside (`<name>.failed-start-<time>-<random>`, said in one line).
        Nothing is removed on a file's word: the marker inside plays no part. Returns whether it was removed."""
        if Checkpointer(self.checkpoints).has_state():
            return False
        if self.made is not None:
            return remove_made(self.made)  # (False: gone elsewhere, or it could not be emptied)
        try:
            aside = move_aside(self.path, "failed-start")
        except OSError as e:
            console.print(f"[yellow]{self.path} existed before this run and is left as it is ({e.strerror}): "
                          "remove it or choose another --name to run again[/]")
            return False
        console.print(f"[yellow]{self.path} existed before this run: moved aside to {aside.name} "
                      "(nothing removed); the same command can be run again[/]")
        return False

    def truncate_metrics(self, after_step: int) -> None:
        """On resume, drop records logged after the checkpoint so the log reads like one run."""
        kept = [line for line in read_metrics(self.path) if line.get("step", 0) <= after_step]
        atomic_write(self.metrics_file, lambda tmp: Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in kept)))

    def write_failure(self, exc: BaseException) -> UserError | None:
        """The message for a run that stopped because a file of its run dir could not be written (no
        permission, read-only or full file system), or None when `exc` is something else. Says which
        path failed and which checkpoint is intact: checkpoint writes are atomic (a temporary file or dir,
        renamed once complete), so a failed one leaves the previous checkpoint as it was."""
        err = os_error_of(exc)
        if err is None or err.errno not in WRITE_ERRNOS:
            return None
        if not isinstance(err, WriteError):  # raised by a write that did not say what it wrote
            if err.filename is not None and not Path(str(err.filename)).resolve().is_relative_to(self.path.resolve()):
                return None  # a file elsewhere (the data): not the run dir's business
            if err.filename is None and err.errno not in NO_SPACE:
                return None
        what = err.filename if err.filename is not None else f"a file in {self.path}"
        detail = f" (at {err.detail})" if getattr(err, "detail", None) else ""
        step = Checkpointer(self.checkpoints).saved_step()
        if step is None:
            then = "No checkpoint had been saved yet: start the run again once it can write there."
        else:
            then = (f"The last checkpoint ({self.checkpoints}, step {step}) is intact: once the run dir can be "
                    "written (permissions, space), continue with the same command and --resume.")
        return UserError(f"could not write {what}{detail}: {err.strerror or os.strerror(err.errno)} "
                         f"[{errno.errorcode.get(err.errno, err.errno)}]. {then}")


def default_name(cfg: Config) -> str:
    return f"{cfg.model.name.replace('/', '-')}-{Path(cfg.data.source).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


# metrics.jsonl is read back line by line (resume, early stop, report, governance), each line bounded before it
# is parsed: a multi-label epoch record of MAX_CLASSES thresholds is ~2.5 MB; a run logging every step of a
# million steps holds ~8 million values. NaN is allowed (a diverged loss is logged as NaN).
METRICS_LINE = JsonBounds(max_bytes=4 << 20, max_values=250_000, max_depth=16, max_str=1 << 20, allow_nonfinite=True)
MAX_METRICS_BYTES = 1 << 30
# The other JSON records of a run dir (eval.json, memory.json, governance.json, skipped_files.json, precision.json,
# allocator.json...), each read whole at most SMALL_JSON_BYTES: kilobytes in practice. torchcls writes them with
# indent 2 or 1 (>= 4 bytes a value), so 4M values fit any of them; the worst text ('[[],...]') then builds
# ~260 MB, and nesting past 32 (a RecursionError in json) is refused. NaN as Python's json writes it.
RUN_RECORD = JsonBounds(max_bytes=SMALL_JSON_BYTES, max_values=4_000_000, max_depth=32, max_str=1 << 20,
                        allow_nonfinite=True)
MAX_METRICS_VALUES = 10_000_000  # in all lines together, counted before each is parsed


class MetricsRecord(TypedDict, total=False):
    """The fields of a metrics.jsonl record that torchcls reads back (resume, early stop, the report, governance,
    tracking): compared, summed or formatted as numbers. Other fields pass unchecked (only shown)."""
    kind: str
    step: NonNegative
    epoch: NonNegative
    loss: float  # (NaN where the loss diverged)
    lr: float
    train_loss: float
    train_top1: float
    val_loss: float
    val_top1: float
    val_top5: float
    val_map: float
    val_f1: float
    img_per_s: float
    epoch_s: float
    best: str
    best_top1: float
    patience: NonNegative


def parse_record(data: bytes, where: str, bounds: JsonBounds = RUN_RECORD) -> Any | None:
    """A run-dir record's JSON under `bounds`; None when it is not JSON at all (a write cut short), a UserError
    naming `where` when it is past a bound (values, nesting, string length)."""
    try:
        return load_bounded(data, bounds, where)
    except NotJson:
        return None


class SkippedFile(TypedDict):
    file: str
    reason: str
    stage: NotRequired[str]
    times: NotRequired[NonNegative]


class SkippedFiles(TypedDict, total=False):
    """skipped_files.json (and eval.json's list): governance rewrites each entry's file and reason after the last
    epoch, the report lists them."""
    skipped_files: list[SkippedFile]


def read_checked(path: Path, bounds: JsonBounds, schema: Any, what: str, hint: str = "", *,
                 follow_symlinks: bool = False) -> Any:
    """The small JSON file `path` (`what`: at most SMALL_JSON_BYTES), parsed under `bounds` and checked against
    `schema`, its errors naming `path` (`hint`: the fix). Raises OSError where it cannot be opened (absent),
    NotJson where it is not JSON, SchemaMismatch where a field is of another type, and a UserError past a bound
    or for a link (followed only with `follow_symlinks`: a file outside a run dir). Each caller says which of
    these it takes as a miss."""
    data = read_bytes(path, max_bytes=SMALL_JSON_BYTES, what=what, follow_symlinks=follow_symlinks)
    return check(load_bounded(data, bounds, str(path)), schema, str(path), hint=hint)


def read_skipped(path: Path, hint: str = "remove it: the files a run leaves out are listed in it again when the "
                 "run ends") -> list[dict[str, Any]]:
    """The entries of skipped_files.json (or of eval.json's list), [] where there is no such file; a UserError
    where it is not JSON of `SkippedFiles`' shape. The resume, governance and the report read it here."""
    if not os.path.lexists(path):
        return []
    return read_checked(path, RUN_RECORD, SkippedFiles, path.name, hint).get("skipped_files", [])


def check_skipped_files(run_dir: Path) -> None:
    """On resume, before any work: the run's skipped_files.json (where it has one) is JSON of `SkippedFiles`' shape,
    else a UserError. Where the resumed run skips no file, the file it came with is the one governance rewrites
    after the last epoch: of another shape, that failed there, and the run's governance record was lost."""
    read_skipped(run_dir / "skipped_files.json")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir`'s metrics.jsonl, every one a JSON object; a last line cut short by a failed write
    (disk full) is left out. Refused (UserError): a longer line, more values or bytes than the bounds above, a
    field of `MetricsRecord` of another type."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records, values, seen = [], 0, 0
    with open_regular(path, "rb", what="metrics log", max_bytes=MAX_METRICS_BYTES,  # (a FIFO would block,
                      follow_symlinks=False) as f:  # and a link of a received run dir is not followed)
        for n, line in enumerate(iter(lambda: f.readline(METRICS_LINE.max_bytes + 1), b""), start=1):
            seen += len(line)
            if len(line) > METRICS_LINE.max_bytes or seen > MAX_METRICS_BYTES:
                raise UserError(f"{path}: line {n} is longer than {METRICS_LINE.max_bytes:,} bytes, or the log "
                                f"longer than {MAX_METRICS_BYTES:,}: not a metrics log torchcls wrote")
            if not line.endswith(b"\n"):
                break  # a record cut short by a failed write: never complete
            if not line.strip():
                continue
            values += line.count(b"{") + line.count(b"[") + line.count(b",") + 1
            if values > MAX_METRICS_VALUES:
                raise UserError(f"{path}: more than {MAX_METRICS_VALUES:,} values by line {n}: refused before parsing")
            record = load_bounded(line, METRICS_LINE, f"{path}: line {n}")
            if not isinstance(record, dict):
                raise UserError(f"{path}: line {n} is not a JSON object, as every metrics record is")
            records.append(check(record, MetricsRecord, f"{path}: line {n}", hint="correct or remove that line "
                                 "(resume, early stop and the report read the log back)"))
    return records

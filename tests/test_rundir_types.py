"""Records of a (possibly received) run dir read back on `train --resume` are typed where each is parsed (review 5,
findings 3 and 4).

machine.json's thread counts (`"torch_threads": 10**10` ended a resume in torch's ValueError; 10**6 would have asked
OpenMP for a million threads), step_choice.json, metrics.jsonl records (`"step": "10"`), skipped_files.json (read
again after the last epoch, where a wrong shape lost the run's governance record) and tracking.json used to end in
a TypeError, KeyError or AttributeError. Each is now a UserError naming the file and the field, or (tracking.json,
which only names the MLflow run to continue) taken as absent. The "next variant" tests replace every value of a
valid record in turn with each JSON type: the reader refuses it (UserError) or takes it, and what reads the record
next then works; never another exception."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import make_image_folder, tiny_config
from torchcls.errors import UserError
from torchcls.governance.outputs import redact_skipped
from torchcls.training import train
from torchcls.training.resume_options import finished_run
from torchcls.training.rundir import RunDir, check_skipped_files, read_metrics
from torchcls.training.step_choice import from_record, read_state
from torchcls.training.thread_tuning import MAX_THREADS, WorkerLoadTuner, read_record, recorded_reservation

SUBSTITUTES = ([], {}, 1, "x", True, None)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """(images, run dir): one real epoch of a two-epoch run, interrupted at the epoch's end, so a resume has one
    epoch left."""
    root = tmp_path_factory.mktemp("rundir_types")
    images = make_image_folder(root / "shapes")
    result = train(tiny_config(images, root / "runs", "base", epochs=1))
    assert not result.interrupted
    return images, result.run_dir


def _copy(base: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    images, run = base
    shutil.copytree(run, tmp_path / "runs" / "run", symlinks=True)
    return images, tmp_path / "runs" / "run"


def _resume(images: Path, run: Path, epochs: int = 2, threads: int = 2):
    """`train --resume` of the copied run dir (threads 0: the count recorded in machine.json applies)."""
    cfg = tiny_config(images, run.parent, run.name, epochs=epochs)
    cfg.run.resume, cfg.train.threads = True, threads
    return train(cfg)


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    """The path of every node under `value` (containers too), the top level excluded."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    found = []
    for k, v in items:
        found += [(*at, k), *_paths(v, (*at, k))]
    return found


def _variants(valid: Any) -> list[Any]:
    """`valid` with one value replaced by each of SUBSTITUTES, for every value in turn."""
    out = []
    for path in _paths(valid):
        for new in SUBSTITUTES:
            variant = copy.deepcopy(valid)
            node = variant
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = new
            out.append(variant)
    return out


def _write(path: Path, value: Any) -> None:
    path.unlink(missing_ok=True)
    path.write_text(json.dumps(value))


# --- the review's payloads: a real resume of a real run dir ----------------------------------------------------


@pytest.mark.parametrize("threads", [10**10, MAX_THREADS + 1, 0, -1, True, "2"])
def test_resume_refuses_a_thread_count_out_of_range(base, tmp_path, threads):
    """10**10 was torch.set_num_threads' ValueError; a count past --threads' bound was applied as it stood."""
    images, run = _copy(base, tmp_path)
    machine = json.loads((run / "machine.json").read_text())
    _write(run / "machine.json", machine | {"torch_threads": threads})
    with pytest.raises(UserError, match=r"machine.json: torch_threads: .*remove it to resume with a new thread count"):
        _resume(images, run, threads=0)


@pytest.mark.parametrize("payload", [[1], {"precision": 5, "channels_last": False},
                                     {"precision": {"requested": "fp32"}, "channels_last": False},
                                     {"precision": {"requested": "fp32", "precision": "fp64", "reason": "r"},
                                      "channels_last": False},
                                     {"precision": {"requested": "fp32", "precision": "fp32", "reason": "r"},
                                      "channels_last": False, "times_ms": 5}])
def test_resume_refuses_a_step_choice_of_another_shape(base, tmp_path, payload):
    """[1], a precision 5, one with no precision, a precision no run trains in, times_ms 5 (TypeError, KeyError;
    fp64 was taken as the run's precision)."""
    images, run = _copy(base, tmp_path)
    _write(run / "step_choice.json", payload)
    with pytest.raises(UserError, match=r"step_choice.json: .*remove it to choose the training step again"):
        _resume(images, run)


def test_resume_refuses_a_metrics_record_with_a_text_step(base, tmp_path):
    """`"step": "10"` was a TypeError in truncate_metrics."""
    images, run = _copy(base, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "epoch", "step": "10"}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl: line \d+: step: .*correct or remove that line"):
        _resume(images, run)


def test_resume_of_a_complete_run_refuses_a_text_score(base, tmp_path):
    """A complete run's best score is formatted as a percentage: "x" was a ValueError there."""
    images, run = _copy(base, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "epoch", "epoch": 1, "step": 4, "val_top1": "x"}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl: line \d+: val_top1: "):
        _resume(images, run, epochs=1)


@pytest.mark.parametrize("payload", [[1], {"skipped_files": [{"reason": "x"}]}, {"skipped_files": 5},
                                     {"skipped_files": [{"file": "a", "reason": 1}]}])
def test_resume_refuses_skipped_files_of_another_shape_before_training(base, tmp_path, payload):
    """Rewritten after the last epoch (governance redacts its names) where the resumed run skips no file: refused
    before any step now, not after the last one."""
    images, run = _copy(base, tmp_path)
    _write(run / "skipped_files.json", payload)
    steps = []
    with pytest.raises(UserError, match=r"skipped_files.json: .*remove it: the files a run leaves out"):
        cfg = tiny_config(images, run.parent, run.name, epochs=2)
        cfg.run.resume = True
        train(cfg, callbacks=[steps.append])
    assert steps == []


def test_resume_with_a_tracking_record_of_another_shape_logs_a_new_mlflow_run(base, tmp_path):
    """tracking.json `[1]` was an AttributeError (`saved.get`); it only names the MLflow run to continue, so a
    record of another shape is taken as absent: the resumed run is logged as a new MLflow run."""
    pytest.importorskip("mlflow")
    images, run = _copy(base, tmp_path)
    _write(run / "tracking.json", [1])
    cfg = tiny_config(images, run.parent, run.name, epochs=2)
    cfg.run.resume, cfg.train.tracking, cfg.train.tracking_uri = True, "mlflow", str(tmp_path / "store")
    result = train(cfg)
    assert not result.interrupted
    assert isinstance(json.loads((run / "tracking.json").read_text())["run_id"], str)


# --- the next variants: every value of a valid record replaced by each JSON type --------------------------------


def test_machine_record_variants(base, tmp_path):
    _, run = _copy(base, tmp_path)
    valid = json.loads((run / "machine.json").read_text()) | {
        "threads_reserved_for_workers": 1, "threads_after_measurement": 2, "worker_load_cpus": 0.5,
        "measured_over_steps": [5, 55]}
    path = run / "machine.json"
    _write(path, valid)
    assert read_record(path) == valid
    refused = 0
    for variant in _variants(valid) + [[], 1, "x", None]:
        _write(path, variant)
        try:
            record = read_record(path)
        except UserError as e:
            assert str(path) in str(e)
            refused += 1
            continue
        assert 0 <= recorded_reservation(record) <= MAX_THREADS
        WorkerLoadTuner(_choice(), path, (5, 55), record)  # reads the measured window and count
    assert refused >= 5 * 4  # each acted-on field refuses every type but its own


def _choice():
    from torchcls.machine import ThreadChoice

    return ThreadChoice(2, "test", 1)


def test_step_choice_variants(base, tmp_path):
    _, run = _copy(base, tmp_path)
    path = run / "step_choice.json"
    valid = json.loads(path.read_text()) | {"times_ms": {"fp32+nchw": 10.0, "fp32+cl": 9}}
    for variant in [valid, *_variants(valid), [], 1, "x", None]:
        _write(path, variant)
        try:
            record = read_state(path)
        except UserError as e:
            assert str(path) in str(e)
            continue
        from_record(record, "resumed").line()


def test_metrics_record_variants(base, tmp_path):
    _, run = _copy(base, tmp_path)
    log = run / "metrics.jsonl"
    epoch = next(r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "epoch")
    valid = epoch | {"loss": 0.5, "lr": 0.1, "best": "raw", "best_top1": 0.9, "patience": 2}
    cfg = tiny_config(run.parent, run.parent, run.name, epochs=1)
    for variant in [valid, *_variants(valid)]:
        log.write_text(json.dumps(variant) + "\n")
        try:
            read_metrics(run)
        except UserError as e:
            assert str(log) in str(e)
            continue
        finished_run(run, cfg)  # the best score, formatted
        RunDir(run).truncate_metrics(0)


def test_skipped_files_variants(base, tmp_path):
    from torchcls.report.sections import _skipped

    _, run = _copy(base, tmp_path)
    path = run / "skipped_files.json"
    valid = {"skipped_files": [{"file": "a/b.png", "reason": "cannot decode a/b.png", "stage": "scan"},
                               {"file": "c.png", "reason": "truncated", "times": 2, "stage": "decode"}]}
    for variant in [valid, *_variants(valid), [], 1, "x", None]:
        _write(path, variant)
        try:
            check_skipped_files(run)
        except UserError as e:
            assert str(path) in str(e)
            try:  # the report refuses it alike, or (JSON null, as a file that is not JSON) lists nothing
                assert _skipped(path, "Skipped training files") == "" and variant is None
            except UserError:
                pass
            continue
        _skipped(path, "Skipped training files")
        redact_skipped(path, lambda name: None, [], [])  # what governance does after the last epoch


def test_tracking_record_variants(base, tmp_path):
    from torchcls.training.tracking import _read_tracking_file

    _, run = _copy(base, tmp_path)
    valid = {"uri": "sqlite:///x/mlflow.db", "experiment_id": "1", "run_id": "abc"}
    for variant in [valid, *_variants(valid), [1], [], 1, "x", None]:
        _write(run / "tracking.json", variant)
        saved = _read_tracking_file(run)
        assert saved == {} or saved == variant
        if saved:
            assert all(isinstance(saved[k], str) for k in valid)

"""--tracking mlflow: real tiny runs logged to real MLflow stores (SQLite file, folder), read back
with MlflowClient; resume continues the same MLflow run; an unreachable store is refused up front."""

from __future__ import annotations

import json
import time

import pytest

from conftest import tiny_config
from torchcls.errors import UserError
from torchcls.training import train

pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store folder for the module: a new SQLite store costs seconds of schema migrations, once."""
    return tmp_path_factory.mktemp("tracking")


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _artifacts(client, run_id: str) -> set[str]:
    top = client.list_artifacts(run_id)
    return {a.path for a in top if not a.is_dir} | {f.path for a in top if a.is_dir
                                                    for f in client.list_artifacts(run_id, a.path)}


def _records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _same(history: list[tuple[int, float]], records: list[dict], key: str) -> bool:
    """The MLflow history is the records' (step, value) series, values to float precision."""
    return [s for s, _ in history] == [r["step"] for r in records] and \
        [v for _, v in history] == pytest.approx([r[key] for r in records])


def test_sqlite_store_holds_params_metrics_artifacts(tmp_path, shapes_dir, store):
    uri = f"sqlite:///{store / 'mlflow.db'}"
    cfg = tiny_config(shapes_dir, tmp_path / "runs", "tracked", epochs=1)
    cfg.train.tracking, cfg.train.tracking_uri, cfg.train.tracking_experiment = "mlflow", uri, "tests"
    cfg.train.log_every, cfg.optim.lr = 1, 2e-3
    result = train(cfg)

    saved = json.loads((result.run_dir / "tracking.json").read_text())
    client = _client(uri)
    run = client.get_run(saved["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params["optim.lr"] == "0.002" and run.data.params["data.batch_size"] == "8"
    assert run.data.params["model.name"] == "smallnet" and run.data.params["train.tracking"] == "mlflow"
    assert run.data.tags["torchcls.run_dir"] == str(result.run_dir.resolve())
    steps = _records(result.run_dir, "step")
    assert len(steps) == result.steps  # --log-every 1: one record per optimizer step
    assert _same(_history(client, run.info.run_id, "loss"), steps, "loss")
    epochs = _records(result.run_dir, "epoch")
    for key in ("train_loss", "val_top1"):
        assert _same(_history(client, run.info.run_id, key), epochs, key)
    assert {"report.html", "metrics.jsonl", "config.toml",
            "checkpoints/best.safetensors"} <= _artifacts(client, run.info.run_id)
    # a local SQLite store keeps its artifacts beside the database
    assert (store / "mlruns" / "tests").is_dir()


def test_folder_store_resume_continues_the_run_and_a_failure_ends_failed(tmp_path, shapes_dir, store):
    cfg = tiny_config(shapes_dir, tmp_path / "runs", "resumed", epochs=2)
    cfg.train.tracking, cfg.train.tracking_uri, cfg.train.log_every = "mlflow", str(store), 2

    def interrupt(step: int) -> None:
        if step == 5:  # in the second epoch (4 steps an epoch)
            raise KeyboardInterrupt

    assert train(cfg, callbacks=[interrupt]).interrupted
    first = json.loads((tmp_path / "runs" / "resumed" / "tracking.json").read_text())["run_id"]
    cfg.run.resume, cfg.optim.lr = True, 1e-3
    result = train(cfg)
    client = _client(f"sqlite:///{store / 'mlflow.db'}")
    assert json.loads((result.run_dir / "tracking.json").read_text())["run_id"] == first
    run = client.get_run(first)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in _history(client, first, "val_top1")] == [4, 8]
    assert run.data.params["optim.lr"] == "0.003"  # MLflow params are immutable: the change is a tag
    assert run.data.tags["resume.changed.optim.lr"] == "0.003 -> 0.001"
    assert "checkpoints/best.safetensors" in _artifacts(client, first)

    def fail(step: int) -> None:
        if step == 2:
            raise RuntimeError("boom")

    cfg = tiny_config(shapes_dir, tmp_path / "runs", "failed", epochs=1)
    cfg.train.tracking, cfg.train.tracking_uri = "mlflow", str(store)
    with pytest.raises(RuntimeError, match="boom"):
        train(cfg, callbacks=[fail])
    failed = json.loads((tmp_path / "runs" / "failed" / "tracking.json").read_text())["run_id"]
    assert client.get_run(failed).info.status == "FAILED"


@pytest.mark.parametrize("uri", ["http://127.0.0.1:9", "/proc/torchcls-no-such-store"])
def test_unreachable_store_is_refused_before_training(tmp_path, shapes_dir, uri):
    cfg = tiny_config(shapes_dir, tmp_path / "runs", "dead", epochs=1)
    cfg.train.tracking, cfg.train.tracking_uri = "mlflow", uri
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="--tracking-uri") as e:
        train(cfg)
    assert time.perf_counter() - t0 < 30, "a dead store must fail in seconds, not after retries"
    assert uri in str(e.value)
    assert not (tmp_path / "runs" / "dead").exists()  # the failed start left no run dir


def test_a_linked_best_checkpoint_is_not_uploaded(tmp_path, store):
    """A resumed received run dir whose best.safetensors is a link (to ~/.ssh/id_ed25519, say), never rewritten
    when its recorded best_top1 stays unbeaten: finish uploads the run's files, not what the link points at."""
    import types

    from torchcls.config import Config
    from torchcls.training.tracking import open_tracker

    run = tmp_path / "runs" / "recv"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    (run / "checkpoints" / "best.safetensors").symlink_to(tmp_path / "id_ed25519")
    (run / "metrics.jsonl").write_text("")
    cfg = Config()
    cfg.train.tracking, cfg.train.tracking_uri = "mlflow", str(store)
    tracker = open_tracker(cfg, run)
    tracker.finish(types.SimpleNamespace(best_checkpoint=run / "checkpoints" / "best.safetensors"))
    assert _artifacts(_client(f"sqlite:///{store / 'mlflow.db'}"), tracker.run_id) == {"metrics.jsonl"}

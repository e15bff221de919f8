"""The CLI as a user runs it: real subprocesses, exit codes, no tracebacks for user mistakes."""

import json
import subprocess
import sys

import pytest

from conftest import draw_shape


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "torchcls", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_help_lists_commands_and_options():
    out = run_cli("--help").stdout
    for cmd in ("train", "evaluate", "predict", "demo"):
        assert cmd in out
    train_help = run_cli("train", "--help").stdout
    assert "--on-bad-file" in train_help and "label smoothing" in train_help


def test_train_evaluate_predict_end_to_end(tmp_path, shapes_dir):
    r = run_cli("train", "--data", shapes_dir, "--epochs", 1, "--workers", 0, "--batch-size", 8,
                "--img-size", 32, "--out-dir", tmp_path, "--name", "cli", "--no-progress")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "cli"
    assert (run / "report.html").is_file() and "best checkpoint" in r.stdout
    r = run_cli("evaluate", run, "--workers", 0, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n"] == 6
    draw_shape("circle", 32, 9).save(tmp_path / "x.png")
    r = run_cli("predict", run, tmp_path / "x.png", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["predictions"][0]["top"][0]["label"] in ("circle", "square")


@pytest.mark.parametrize("args, message", [
    (["train", "--data", "/nonexistent/dir"], "not a built-in data set"),
    (["train", "--model", "resnet81", "--data", "mnist-5k"], "Did you mean"),
    (["train", "--config", "/nonexistent.toml"], "does not exist"),
    (["evaluate", "/nonexistent.safetensors"], "does not exist"),
    (["predict", "/nonexistent.safetensors", "x.png"], "does not exist"),
    (["train", "--data", "fashion-mnist", "--root", "/nonexistent"], "dataset-fashion-mnist"),
])
def test_user_errors_exit_2_without_traceback(tmp_path, args, message):
    r = run_cli(*args, "--no-progress" if args[0] == "train" else "--device=cpu", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_bad_files_cli(tmp_path, shapes_dir):
    (shapes_dir / "circle" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    r = run_cli("train", "--data", shapes_dir, "--epochs", 1, "--workers", 0, "--img-size", 16,
                "--out-dir", tmp_path, "--name", "e", "--no-progress")
    assert r.returncode == 2 and "broken.png" in r.stderr and "--on-bad-file skip" in r.stderr
    r = run_cli("train", "--data", shapes_dir, "--epochs", 1, "--workers", 0, "--img-size", 16,
                "--out-dir", tmp_path, "--name", "s", "--no-progress", "--on-bad-file", "skip")
    assert r.returncode == 0, r.stderr
    assert "broken.png" in (tmp_path / "s" / "report.html").read_text()


def test_demo_command_trains_evaluates_and_reports(tmp_path):
    r = run_cli("demo", "--epochs", 2, "--out-dir", tmp_path, "--name", "d")
    assert r.returncode == 0, r.stderr
    ev = json.loads((tmp_path / "d" / "eval.json").read_text())
    assert ev["data"] == "mnist-5k" and ev["split"] == "val" and ev["n"] == 1000
    assert ev["top1"] > 0.7  # two epochs of real digits already beat chance (10%) by far
    assert "held-out top-1" in r.stdout and (tmp_path / "d" / "report.html").is_file()
    # Not a terminal: one unbroken line per epoch (rich used to wrap at 80 columns).
    epochs = [line for line in r.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all("val top1" in line and line.endswith("img/s") for line in epochs), r.stdout


def test_data_shard_command_writes_shards_and_index(tmp_path):
    r = run_cli("data", "shard", "mnist-5k", "--out", tmp_path / "shards", "--shard-size", "1MB")
    assert r.returncode == 0, r.stderr
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert sum(s["samples"] for s in index["shards"]) == 5000 and len(index["shards"]) > 1
    assert "5000 samples" in r.stdout
    r = run_cli("data", "shard", "mnist-5k", "--out", tmp_path / "shards")  # never over a finished set
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr

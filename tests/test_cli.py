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
def test_user_errors_exit_2_without_traceback(tmp_path, args, message, monkeypatch, capsys):
    """In this process (the entry point's own subprocess runs in the end-to-end test): main() returns 2 with
    the message, where an exception would be a traceback."""
    from torchcls.cli import main

    monkeypatch.chdir(tmp_path)
    code = main([*args, "--no-progress" if args[0] == "train" else "--device=cpu"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


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


# --- what a user meets first: mistakes, pipes, finished runs, optional parts, a quiet terminal ---

def test_a_misspelled_option_gets_the_commands_usage_and_a_suggestion(capsys):
    from torchcls.cli import main

    for argv, usage, hint in ((["train", "--epochss", "1"], "usage: torchcls train", "did you mean --epochs?"),
                              (["bench", "compile", "--models", "x", "--batchs", "1"], "usage: torchcls bench compile",
                               "did you mean --batch?")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(usage) and hint in err, err


def test_wrong_values_are_refused_for_the_right_reason(tmp_path, monkeypatch, capsys):
    from torchcls.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-images").mkdir()
    for argv, message in ((["--batch-size", "0"], "[data] batch_size = 0 is outside the allowed range 1 to 65,536 (images "
                                                  "per training step"),
                          (["--data", "mnist5k"], "(did you mean 'mnist-5k'?)"),
                          (["--data", "my-imgs"], "(did you mean 'my-images'?)")):
        assert main(["train", "--data", "mnist-5k", *argv, "--out-dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err
        assert message in err and "world size" not in err, err
    assert not list((tmp_path / "runs").glob("*"))  # no run dir is left behind


def test_predict_into_a_closed_pipe_ends_quietly(trained_run, tmp_path):
    draw_shape("circle", 32, 3).save(tmp_path / "x.png")
    p = subprocess.Popen([sys.executable, "-m", "torchcls", "predict", str(trained_run), str(tmp_path / "x.png"),
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before anything is printed: `| head` that already exited
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err  # the shell's code for SIGPIPE, as `cat` or `yes` give
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_resume_of_a_finished_run_says_so_and_how_to_train_further(trained_run, tmp_path, capsys):
    import shutil

    from torchcls.cli import main

    run = tmp_path / "shapes"
    shutil.copytree(trained_run, run)
    metrics = (run / "metrics.jsonl").read_text()
    resume = ["train", "--config", str(run / "config.toml"), "--resume", "--out-dir", str(tmp_path), "--name", "shapes"]
    assert main(resume) == 0
    out = capsys.readouterr().out
    assert f"{run} is complete: it has trained 8 of 8 epoch(s)" in out and "resuming" not in out
    assert f"torchcls train --config {run / 'config.toml'} --resume --epochs 16" in out
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing ran
    assert main([*resume, "--epochs", "9"]) == 0  # what it suggests works: one more epoch
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line]
    assert [r["epoch"] for r in epochs if r["kind"] == "epoch"] == list(range(1, 10))


ALARMING = ("gpuGetDeviceCount", "USDT:", "ERROR", "No CUDA runtime is found", "Failed to open midr file",
            "is an Enum subclass", "will have no effect on the learning rate", "Traceback")


def test_a_successful_run_prints_nothing_that_reads_as_an_error(tmp_path, shapes_dir):
    # One optimizer step (timm's cosine warned that it "will have no effect") with the CPU memory report
    # (the profiler's GPU probe printed "ERROR: gpuGetDeviceCount failed").
    r = run_cli("train", "--data", shapes_dir, "--epochs", 1, "--batch-size", 64, "--workers", 0, "--img-size", 16,
                "--memory-report", "--out-dir", tmp_path, "--name", "quiet", "--no-progress")
    assert r.returncode == 0, r.stderr
    found = [a for a in ALARMING if a in r.stdout + r.stderr]
    assert not found, r.stdout + r.stderr
    assert json.loads((tmp_path / "quiet" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


def test_aoti_and_serve_import_no_cuda_runtime_warning(tmp_path):
    import os

    import torch

    # torch.utils.cpp_extension warns at import when a CUDA toolkit is found and no GPU (AOTInductor, serve).
    env = os.environ | {"CUDA_HOME": str(tmp_path)}
    quiet = subprocess.run([sys.executable, "-c", "import torchcls, torch.utils.cpp_extension"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "No CUDA runtime" not in quiet.stderr, quiet.stderr
    if not torch.cuda.is_available():  # the line is there without torchcls's filter: the check above means something
        loud = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert "No CUDA runtime is found" in loud.stderr


def test_export_shows_its_phases_on_a_terminal_and_nothing_in_a_pipe(trained_run, tmp_path):
    import os
    import pty

    cmd = [sys.executable, "-m", "torchcls", "export", str(trained_run), "--target", "onnx", "--parity-images", "32"]
    main_fd, child_fd = pty.openpty()
    p = subprocess.Popen([*cmd, "--out", str(tmp_path / "tty.onnx")], stdin=child_fd, stdout=child_fd,
                         stderr=child_fd, env=os.environ | {"TERM": "xterm", "COLUMNS": "120"})
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    assert p.wait(timeout=600) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "export: build (onnx" in shown and "wrote " in shown, shown
    piped = run_cli(*cmd[3:], "--out", tmp_path / "pipe.onnx")
    assert piped.returncode == 0 and "export:" not in piped.stdout + piped.stderr, piped.stdout


def test_missing_extra_names_the_install_command_that_works_from_here(monkeypatch, tmp_path):
    import re
    from pathlib import Path

    from torchcls import extras
    from torchcls.artifacts.targets import onnx
    from torchcls.artifacts.targets.base import ExportRequest
    from torchcls.errors import UserError

    root = extras.source_checkout()
    assert root == Path(__file__).resolve().parents[1]  # the tests run from this checkout
    monkeypatch.chdir(root)
    assert extras.install_command("serve").endswith("install -e '.[serve]'")
    monkeypatch.chdir(tmp_path)
    assert extras.install_command("serve").endswith(f"install -e '{root}[serve]'")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # not installed: the import fails
    with pytest.raises(UserError, match=re.escape(f"--target onnx needs the 'export' extra (onnxscript is not "
                                                  f"installed): {extras.install_command('export')}")):
        onnx.check(ExportRequest("fp32", 8))
    monkeypatch.setattr(extras, "source_checkout", lambda: None)  # an installed wheel
    assert extras.install_command("serve").endswith("pip install 'torchcls[serve]'")
    # every hint is made here: no module spells its own install command
    spelled = [str(p) for p in (root / "src" / "torchcls").rglob("*.py")
               if p.name != "extras.py" and re.search(r"pip install .?torchcls\[", p.read_text())]
    assert not spelled

"""Special files (issue 30, finding 6): every path taken from input is opened without blocking and read
only when the open file is a regular file. A `.pt2` symlinked to a FIFO used to hang `predict` and
`serve` (read_lineage -> safetensors' safe_open, before any check); a FIFO, a socket, a device such as
/dev/zero or a directory given where a file is expected is now a UserError naming the path, at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from torchcls.errors import UserError
from torchcls.io_files import check_regular, open_regular, read_bytes, read_text, regular_path

SRC = Path(__file__).resolve().parents[1] / "src"
REFUSED = "must be a regular file"


@contextmanager
def no_hang(seconds: float = 10.0) -> Iterator[None]:
    """Fail instead of blocking: a blocked open() or read() of a FIFO is interrupted by the alarm."""
    def alarm(*_):
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _special(tmp_path: Path, kind: str, name: str) -> Path:
    """`name` in a fresh folder, as a FIFO, a symlink to one, a socket, a symlink to /dev/zero, or a directory."""
    folder = tmp_path / kind
    folder.mkdir(exist_ok=True)
    path = folder / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "fifo-link":
        os.mkfifo(folder / "pipe")
        path.symlink_to(folder / "pipe")
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        # bound by its name inside the folder: a socket's path is limited to 107 bytes, which a deep
        # pytest temp folder (a parallel worker's, a long TMPDIR) exceeds
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            s.bind(name)  # (kept bound: the test's process outlives the call)
        finally:
            os.chdir(cwd)
        _SOCKETS.append(s)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    return path


_SOCKETS: list[socket.socket] = []
KINDS = ("fifo", "fifo-link", "socket", "dev-zero", "directory")


# -- the helper itself --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path, kind) -> None:
    path = _special(tmp_path, kind, "f.bin")
    for call in (lambda: open_regular(path), lambda: read_bytes(path, max_bytes=10), lambda: check_regular(path),
                 lambda: read_text(path, max_bytes=10), lambda: regular_path(path).__enter__()):
        start = time.monotonic()
        with no_hang(), pytest.raises(UserError, match=REFUSED) as err:
            call()
        assert str(path) in str(err.value) and time.monotonic() - start < 5


def test_open_regular_reads_regular_files_under_a_bound(tmp_path) -> None:
    f = tmp_path / "f.txt"
    f.write_text("héllo")
    assert read_text(f, max_bytes=100) == "héllo" and read_bytes(f, max_bytes=6) == "héllo".encode()
    with pytest.raises(UserError, match="at most 5 bytes, and this one is 6"):
        read_bytes(f, max_bytes=5)
    with open_regular(f, "r") as fh:
        assert fh.read() == "héllo"
    link = tmp_path / "link.txt"
    link.symlink_to(f)
    assert read_bytes(link, max_bytes=10) == f.read_bytes()  # a symlink to a regular file is followed
    with pytest.raises(UserError, match="symbolic link"):
        read_bytes(link, max_bytes=10, follow_symlinks=False)
    with pytest.raises(FileNotFoundError):  # a missing file stays an OSError: callers keep their own message
        read_bytes(tmp_path / "missing", max_bytes=10)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(UserError, match="must be UTF-8 text"):
        read_text(tmp_path / "latin1.txt", max_bytes=10)


def test_the_open_descriptor_decides_not_the_name(tmp_path, monkeypatch) -> None:
    """A FIFO swapped in after the look by name (simulated: stat says "regular file") is still refused,
    by fstat of what was actually opened, without blocking."""
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    fifo = tmp_path / "swapped"
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(regular) if str(p) == str(fifo) else real_stat(p, *a, **k))
    with no_hang(), pytest.raises(UserError, match="this is a FIFO"):
        read_bytes(fifo, max_bytes=10)


def test_regular_path_hands_the_checked_file_whatever_replaces_its_name(tmp_path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"checked")
    with regular_path(f) as checked:
        f.unlink()
        os.mkfifo(f)  # swapped after the check: what a library opens through `checked` is still the file
        with no_hang(), open(checked, "rb") as g:
            assert g.read() == b"checked"


# -- finding 6, as reported: predict and serve of a .pt2 symlinked to a FIFO -------------------------------------
def _cli(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torchcls", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("command", ["predict", "serve"])
def test_finding6_a_pt2_symlinked_to_a_fifo_is_refused_at_once(tmp_path, command) -> None:
    from PIL import Image

    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "model.pt2").symlink_to(tmp_path / "pipe")
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    args = ["model.pt2", "x.png"] if command == "predict" else ["model.pt2", "--port", "0"]
    proc, took = _cli(command, *args, cwd=tmp_path)  # (timeout=60: it used to block forever)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"model.pt2: an artifact {REFUSED}, and this is a FIFO" in proc.stderr and "Traceback" not in proc.stderr
    assert took < 60


@pytest.mark.slow
def test_predict_refuses_dev_zero_as_a_checkpoint(tmp_path) -> None:
    (tmp_path / "model.safetensors").symlink_to("/dev/zero")  # a char device: a read would never end
    proc, _ = _cli("predict", "model.safetensors", "x.png", cwd=tmp_path)
    assert proc.returncode == 2 and REFUSED in proc.stderr and "character device" in proc.stderr, proc.stderr[-2000:]


# -- every input kind, in this process --------------------------------------------------------------------------
def _inputs() -> dict[str, tuple[str, Callable[[Path], object], tuple[str, ...]]]:
    """input kind -> (file name, the reader it goes through, the special kinds that apply)."""
    from torchcls.artifacts.artifact import load_artifact
    from torchcls.checkpoint.files import read_meta
    from torchcls.config import load_toml
    from torchcls.data.hf import open_hf
    from torchcls.data.images import BadImage, load_image
    from torchcls.data.shards import open_shards
    from torchcls.data.sources import open_source
    from torchcls.governance.manifest import load_manifest
    from torchcls.governance.policy import load_policy
    from torchcls.provenance.sidecars import read_lineage

    def image(path: Path) -> None:  # the decoder says BadImage (skippable); predict names the file in a UserError
        try:
            load_image(path, 3)
        except BadImage as e:
            raise UserError(f"{path}: {e}") from None

    def sidecar(path: Path) -> None:
        artifact = path.with_name("model.onnx")
        artifact.write_bytes(b"x")
        read_lineage(artifact)

    files = ("fifo", "fifo-link", "socket", "dev-zero", "directory")
    named = ("fifo", "fifo-link", "socket", "dev-zero")  # (a directory of this name means something else)
    return {
        "config": ("c.toml", load_toml, files),
        "policy": ("p.toml", load_policy, files),
        "manifest": ("m.json", load_manifest, files),
        "csv-manifest": ("data.csv", lambda p: open_source(str(p), None, "train", 3, "error"), named),
        "checkpoint": ("model.safetensors", read_meta, files),
        "artifact-pt2": ("model.pt2", load_artifact, files),
        "artifact-onnx": ("model.onnx", load_artifact, named),
        "lineage-sidecar": ("model.onnx.lineage.json", sidecar, files),
        "image": ("x.png", image, files),
        "shard": ("s.tar", lambda p: open_shards(str(p)), named),
        "parquet": ("d.parquet", lambda p: open_hf(str(p)), named),
    }


CASES = [(name, kind) for name, (_, _, kinds) in _inputs().items() for kind in kinds]


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_every_input_refuses_special_files_at_once(tmp_path, name, kind) -> None:
    filename, read, _ = _inputs()[name]
    path = _special(tmp_path, kind, filename)
    start = time.monotonic()
    with no_hang(), pytest.raises(UserError) as err:
        read(path)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert str(path.name) in message, message
    if name not in LOOSER:
        assert REFUSED in message and KIND_WORDS[kind] in message, message


# The image decoder reports a bad file in its own words (BadImage, counted with the skipped files): refused at
# once all the same.
LOOSER = {"image"}
KIND_WORDS = {"fifo": "FIFO", "fifo-link": "FIFO", "socket": "socket", "dev-zero": "character device",
              "directory": "directory"}

"""`torchcls serve --model-process`: the model in a process of its own, fed by the batcher thread.

In the server's process an eager model hands the GIL back after every operator and must take it
again before the next one, while the event loop and the JSON parsing hold it (and every torch call
on the loop waits for the model thread in turn). In its own process the model never waits for the
HTTP side, at the cost of a second interpreter (its own copy of torch and of the weights) and of
copying each batch through a socket as raw float32 bytes. Measured on a quiet 2-core machine
(`benchmarks/serve_load.py --compare-model-process`, ResNet-18 at 64 px, 32 clients, the server on
Hypercorn): 385 images/s (88% of the raw artifact) against 267 (61%) with the model in a thread, so
it is the default where the model runs on the CPU and the process may use 2 or more CPUs
(serve/app.py wants_model_process); on one CPU there is nothing for a second process to run on.

The child (`python -m torchcls.serve.worker`, a fresh interpreter: nothing of the server's
process is forked or re-imported) loads the artifact itself, checking the same pinned SHA-256 as
the server did; it ignores SIGINT/SIGTERM (the server stops it after draining its queue) and exits
when its socket closes, so it never outlives the server, even one that was killed.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from torchcls.errors import UserError

_OK, _USER_ERROR, _ERROR = b"K", b"U", b"E"


class ModelProcessError(RuntimeError):
    """The model process failed or is gone (answered with a 500; details in the server log)."""


def _load(path: str, expect_sha256: str | None, device: str = "auto", trust: bool = False, precision: str = "auto"):
    from torchcls.artifacts.artifact import load_artifact

    return load_artifact(path, expect_sha256=expect_sha256, device=device, trust=trust, precision=precision)


def _child(path: str, expect_sha256: str | None, threads: int, conn: Connection, device: str = "auto",
           trust: bool = False, precision: str = "auto") -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C reaches the whole process group
        signal.signal(sig, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    try:
        artifact = _load(path, expect_sha256, device, trust, precision=precision)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which stops with the message
        conn.send_bytes(_ERROR + f"loading {path} in the model process failed: {e}".encode())
        return
    pre = artifact.info.preprocess
    shape = (pre.channels, pre.img_size, pre.img_size)
    conn.send_bytes(_OK)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the server is gone
        if not data:
            return  # the server's stop message
        try:
            x = torch.frombuffer(bytearray(data), dtype=torch.float32).view(-1, *shape)
            reply = _OK + artifact(x).contiguous().numpy().tobytes()
        except UserError as e:
            reply = _USER_ERROR + str(e).encode()
        except Exception as e:  # noqa: BLE001 - one failed batch is answered, the process keeps serving
            reply = _ERROR + f"{type(e).__name__}: {e}".encode()
        conn.send_bytes(reply)


class ModelProcess:
    """`model(x)` -> float32 logits, computed in a child process (one batch at a time)."""

    def __init__(self, path: str | Path, expect_sha256: str | None = None, threads: int = 0, device: str = "auto",
                 trust: bool = False, precision: str = "auto"):
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "torchcls.serve.worker", str(path), "--fd", str(theirs.fileno()),
               "--threads", str(threads), "--device", device, "--precision", precision] + \
            (["--expect-sha256", expect_sha256] if expect_sha256 else []) + (["--trust-artifact"] if trust else [])
        self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._loaded = False

    def _exchange(self, payload) -> bytes:
        try:
            if payload is not None:
                self._conn.send_bytes(payload)
            return self._conn.recv_bytes()
        except (EOFError, OSError, BrokenPipeError):
            try:
                code = self._proc.wait(1)
            except subprocess.TimeoutExpired:
                code = None
            raise ModelProcessError(f"the model process exited (code {code})") from None

    @staticmethod
    def _check(reply: bytes) -> bytes:
        if reply[:1] == _USER_ERROR:
            raise UserError(reply[1:].decode(errors="replace"))
        if reply[:1] != _OK:
            raise ModelProcessError(reply[1:].decode(errors="replace"))
        return reply[1:]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise UserError(f"input must be a float32 tensor, got {x.dtype}")
        with self._lock:
            if not self._loaded:  # the first call waits for the child to load the artifact
                self._check(self._exchange(None))
                self._loaded = True
            body = self._check(self._exchange(x.contiguous().numpy()))
        return torch.frombuffer(bytearray(body), dtype=torch.float32).view(x.shape[0], -1)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (after the batcher has drained); kill it if it does not stop in time."""
        if self._lock.acquire(timeout=timeout):  # never write into a batch still on its way
            try:
                self._conn.send_bytes(b"")
            except OSError:
                pass
            self._lock.release()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

    @property
    def pid(self) -> int:
        return self._proc.pid


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="the model process of `torchcls serve` (started by the server)")
    p.add_argument("artifact")
    p.add_argument("--fd", type=int, required=True, help="the socket to the server")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--expect-sha256")
    p.add_argument("--device", default="auto")
    p.add_argument("--trust-artifact", action="store_true")
    p.add_argument("--precision", default="auto")
    args = p.parse_args(argv)
    _child(args.artifact, args.expect_sha256, args.threads, Connection(args.fd), args.device, args.trust_artifact,
           precision=args.precision)


if __name__ == "__main__":
    main()

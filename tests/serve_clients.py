"""Raw-socket clients and a logged `torchcls serve` process, shared by the serve bounds tests.

Every wait here polls something the server reports (its /metrics counters, its sockets as psutil sees
them, the bytes it sends) under a generous overall timeout: none asserts how long a bound took to fire.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from test_serve import free_port

MiB = 2**20
INFER = "/v2/models/shapes/infer"
PATIENCE_S = 30.0  # the longest any poll below waits: far above every bound the test servers set


class LoggedServer:
    """`torchcls serve` with its log in a file (read while it runs; a pipe nobody reads could fill)."""

    def __init__(self, artifact: Path, log: Path, *flags: str):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "torchcls", "serve", str(artifact), "--port",
                                      str(self.port), "--threads", "1", *flags], stdout=self.out,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.25)
        self.stop()
        raise AssertionError(f"server did not become ready: {log.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.out.close()

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(httpx.get(f"{self.url}/metrics", timeout=PATIENCE_S).text, name, **labels)

    def wait_metric(self, name: str, at_least: float, **labels: str) -> float:
        """The metric once it reaches `at_least`, or its value after PATIENCE_S (the caller's assert fails)."""
        deadline = time.monotonic() + PATIENCE_S
        while (value := self.metric(name, **labels)) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        return value

    def closed(self, reason: str) -> float:
        return self.metric("torchcls_connections_closed_total", reason=reason)

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def holds(self, port: int) -> bool:
        """Whether the server process still has its end of the connection from local `port` open."""
        return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
                   for c in psutil.Process(self.proc.pid).net_connections("tcp"))


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in a Prometheus text page whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = re.findall(rf"^{name}(?:{{(.*)}})? (\S+)$", text, re.M)  # label values may hold braces
    return sum(float(v) for got, v in found if all(w in got for w in want))


def wait_until(condition, what: str) -> None:
    """Poll `condition` until it holds; after PATIENCE_S fail, saying `what` never happened."""
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {PATIENCE_S:g} s"
        time.sleep(0.05)


def connect(server: LoggedServer, timeout: float = PATIENCE_S) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a socket timeout fails the test)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:  # it closed with our bytes unread: a reset may follow its answer
        pass
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def post_head(length: int | None, path: str = INFER, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}{extra}\r\n".encode()


def read_responses(sock: socket.socket, n: int) -> list[int]:
    """The statuses of the next `n` answers on a keep-alive connection (each with a Content-Length)."""
    buf, statuses = b"", []
    while len(statuses) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return statuses
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        while len(buf) < length:
            buf += sock.recv(65536)
        buf = buf[length:]
        statuses.append(status_of(head))
    return statuses


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # closed by the reader when it has read enough, or by the server
        pass


def trickle_headers(sock: socket.socket, most: int = 150) -> int:
    """Header lines sent one every 0.2 s after a request line, until the server closes the connection or
    `most` lines (30 s) were sent: the number sent."""
    sent = 0
    try:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        while sent < most:
            sock.sendall(b"X-Slow: %d\r\n" % sent)
            sent += 1
            time.sleep(0.2)
    except OSError:  # reset or broken pipe: the server closed it
        pass
    return sent


def endless(sock: socket.socket, start: bytes, most: int = 64 * MiB) -> int:
    """`start`, then `a`s with no end of line, until the server closes the connection or `most` bytes went."""
    sent = 0
    try:
        sock.sendall(start)
        while sent < most:
            sock.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass
    return sent


def holding_bodies(server: LoggedServer, n: int, prefix: int = 16384) -> list[socket.socket]:
    """n infer requests in progress: headers of a 1 MB body and its first `prefix` bytes (at the default
    1 KiB/s, `prefix` // 1024 s of credit), once the server has taken all their bytes in."""
    before = server.metric("torchcls_inflight_body_bytes")
    socks = []
    for _ in range(n):
        sock = connect(server)
        sock.sendall(post_head(1_000_000) + b"[" * prefix)
        socks.append(sock)
    assert server.wait_metric("torchcls_inflight_body_bytes", before + n * prefix) >= before + n * prefix
    return socks


def never_reading(server: LoggedServer, path: bytes = b"/v2/models/" + b"n" * 3000) -> socket.socket:
    """A client with a 4 KiB receive window that pipelines ~6 MiB of requests, each answered with a 3 KiB 404
    (the kernel's send buffer on loopback grows to 4 MiB), and never reads a byte."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect(("127.0.0.1", server.port))
    request = b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path
    threading.Thread(target=send_quietly, args=(sock, request * 2000), daemon=True).start()
    return sock

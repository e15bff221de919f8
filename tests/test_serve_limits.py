"""The bounds of `torchcls serve` against slow, large and vanishing clients, over real sockets on 127.0.0.1.

One real server with short deadlines (--header-timeout 1.5, --body-timeout 4, --send-timeout 2) and
small caps (--max-header-kb 4, --max-connections 8, --max-inflight-mb 64): slow headers and bodies are
cut off, oversized headers get 431, a body that does not fit the in-flight budget gets 503 before it is
read, 31 MiB parse bombs are refused at a small CPU cost while a normal infer is answered, the probes
are answered at the connection cap, a client leaving mid-body is a 499 with one log line, connections
answered before their body, clients that never read and pipelining floods hold nothing for ever, and
binary outputs reach the real tritonclient as binary.
"""

from __future__ import annotations

import importlib.util
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
from test_serve import free_port, images_of, infer_body, preprocessed  # noqa: E402
from torchcls.serve.admission import ConnectionLimits, Connections  # noqa: E402
from torchcls.serve.metrics import LOG_LINES_PER_S  # noqa: E402
from torchcls.serve.pace import BodyPace  # noqa: E402

pytestmark = pytest.mark.slow
MiB = 2**20
INFER = "/v2/models/shapes/infer"


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
        text = httpx.get(f"{self.url}/metrics").text
        want = [f'{k}="{v}"' for k, v in labels.items()]
        found = re.findall(rf"^{name}(?:{{(.*)}})? (\S+)$", text, re.M)  # label values may hold braces
        return sum(float(v) for got, v in found if all(w in got for w in want))

    def wait_metric(self, name: str, at_least: float, **labels: str) -> float:
        """The metric once it reaches `at_least` (the app counts a request after its connection is gone)."""
        deadline = time.monotonic() + 10
        while (value := self.metric(name, **labels)) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        return value

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system


@pytest.fixture(scope="module")
def bounded(trained_run, tmp_path_factory):
    s = LoggedServer(trained_run, tmp_path_factory.mktemp("bounds") / "serve.log", "--header-timeout", "1.5",
                     "--body-timeout", "4", "--max-header-kb", "4", "--max-connections", "8",
                     "--max-body-mb", "32", "--max-inflight-mb", "64", "--max-batch", "8", "--send-timeout", "2")
    yield s
    assert s.stop() == 0


def connect(server: LoggedServer, timeout: float = 30) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    return sock


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


def test_slow_and_idle_clients_are_cut_off(bounded):
    """Headers trickled one line every 0.2 s: 408 and closed; a connection that sends nothing: closed."""
    before = bounded.metric("torchcls_connections_closed_total", reason="header_timeout")
    slow, idle = connect(bounded), connect(bounded)
    slow.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
    lines = 0
    try:
        while lines < 150:  # 30 s of trickling at most: the old server never closed it
            slow.sendall(b"X-Slow: %d\r\n" % lines)
            lines += 1
            time.sleep(0.2)
    except OSError:  # reset or broken pipe: the server closed it
        pass
    assert lines < 150, "the slow client was never cut off"
    assert status_of(read_all(slow)) in (408, 0)
    assert read_all(idle) == b""  # closed without a word: it had begun no request
    slow_body = connect(bounded)  # a body that stops after 8 KiB (8 s of credit at 1 KiB/s): 408 at --body-timeout
    slow_body.sendall(post_head(100_000) + b"[" * 8192)
    answer = read_all(slow_body)
    assert status_of(answer) == 408 and b"--body-timeout" in answer
    assert bounded.metric("torchcls_connections_closed_total", reason="header_timeout") >= before + 2
    assert bounded.wait_metric("torchcls_requests_total", 1, status="408") >= 1
    assert httpx.get(f"{bounded.url}/v2/health/live").status_code == 200


def test_oversized_headers_get_431_before_they_are_buffered(bounded):
    huge = connect(bounded)
    huge.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    try:
        while sent < 64 * MiB:  # the old server buffered all of it
            huge.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass
    assert sent < 64 * MiB
    assert status_of(read_all(huge)) in (431, 0)
    many = connect(bounded)  # 101 short header lines: under 4 KiB, still refused
    many.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101))
                 + b"\r\n")
    answer = read_all(many)
    assert status_of(answer) == 431 and b"header lines" in answer
    assert bounded.metric("torchcls_connections_closed_total", reason="header_too_large") >= 2
    ok = httpx.get(f"{bounded.url}/v2/health/live", headers={"X-Fine": "b" * 3000})  # under the cap
    assert ok.status_code == 200


def test_bodies_share_one_budget_and_a_declared_body_that_does_not_fit_is_refused_unread(bounded):
    """Two clients hold 30 MiB each of a 64 MiB budget; a third declaring 31 MiB gets 503 at once."""
    holders = [connect(bounded) for _ in range(2)]
    for h in holders:
        h.sendall(post_head(31 * MiB) + b" " * (30 * MiB))
    deadline = time.monotonic() + 3
    while bounded.metric("torchcls_inflight_body_bytes") < 60 * MiB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bounded.metric("torchcls_inflight_body_bytes") >= 60 * MiB
    third = connect(bounded)
    third.sendall(post_head(31 * MiB))  # no body byte sent: the answer comes before any is read
    answer = read_all(third)
    assert status_of(answer) == 503 and b"--max-inflight-mb" in answer
    assert re.search(rb"retry-after: 1", answer, re.I)
    for h in holders:  # mid-body disconnects: 499, the bytes are given back
        h.close()
    deadline = time.monotonic() + 10
    while bounded.metric("torchcls_inflight_body_bytes") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bounded.metric("torchcls_inflight_body_bytes") == 0
    assert bounded.wait_metric("torchcls_requests_total", 2, status="499") >= 2
    assert bounded.metric("torchcls_requests_total", status="500") == 0


def test_many_large_bodies_stay_within_the_budget(bounded):
    """8 concurrent 31 MiB bodies: the server's peak RSS grows by about the budget, not 8 x 31 MiB x 2."""
    proc = psutil.Process(bounded.proc.pid)
    rss_before = proc.memory_info().rss
    body = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [' + \
        b"0," * (31 * MiB // 2 - 64) + b"0]}]}"

    def send(_):
        try:
            with httpx.Client(timeout=60) as c:
                return c.post(f"{bounded.url}{INFER}", content=body).status_code
        except httpx.TransportError:  # refused mid-body (503 and close) while still sending
            return 0

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(send, range(8)))
    assert set(codes) <= {400, 503, 0} and 400 in codes, codes  # 400: too many values for the shape
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{bounded.proc.pid}/status").read_text()).group(1)) * 1024
    assert (peak - rss_before) / MiB < 200, (rss_before / MiB, peak / MiB)  # the old server: > 500 MiB


def test_parse_bombs_are_refused_cheaply_while_infer_works(bounded, trained_run):
    bomb = (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": ['
            + b"[]," * (31 * MiB // 3 - 40) + b"[]]}]}")
    assert len(bomb) < 31 * MiB
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    cpu_before = bounded.cpu_seconds()
    with ThreadPoolExecutor(3) as pool:
        bombs = [pool.submit(httpx.post, f"{bounded.url}{INFER}", content=bomb, timeout=120) for _ in range(2)]
        good = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=120)
        answers = [b.result() for b in bombs]
    assert good.status_code == 200, good.text
    for r in answers:
        assert r.status_code == 400 and "values" in r.json()["error"], r.text
    # The old server spent ~21 s of CPU per bomb building nested lists; this one counts bytes.
    assert bounded.cpu_seconds() - cpu_before < 4


def test_probes_are_answered_at_the_connection_cap_and_slow_clients_make_room(bounded, trained_run):
    holders = []
    try:
        for _ in range(8):  # 8 bodies ahead of the minimum rate (16 KiB: 16 s of credit): the cap, none evictable
            h = connect(bounded)
            h.sendall(post_head(1_000_000) + b"[" * 16384)
            holders.append(h)
        time.sleep(0.3)
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
            assert httpx.get(f"{bounded.url}{path}").status_code == 200, path
        x = torch.zeros(1, 3, 32, 32)
        assert httpx.post(f"{bounded.url}{INFER}", json=infer_body(x)).status_code == 503
    finally:
        for h in holders:
            h.close()
    time.sleep(0.3)
    evicted = bounded.metric("torchcls_connections_closed_total", reason="evicted")
    slow = [connect(bounded) for _ in range(8)]  # 8 slowloris connections fill the cap...
    for s in slow:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
    time.sleep(0.3)
    r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x))  # ...and a real request closes the oldest
    assert r.status_code == 200, r.text
    assert bounded.metric("torchcls_connections_closed_total", reason="evicted") > evicted
    for s in slow:
        s.close()


class BodyFlood:
    """Connections that send an infer request's headers (Content-Length 1 MB) and then one body byte every
    0.1 s, each reopened as soon as the server answers or closes it: a slow-body flood that takes back every
    slot it loses. `seen` counts the statuses of the answers its connections got, `named` those that name
    --min-body-rate-kb."""

    def __init__(self, server: LoggedServer, n: int):
        self.server, self.seen, self.named, self.stop = server, Counter(), 0, threading.Event()
        self.socks = [self._open() for _ in range(n)]
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket:
        sock = connect(self.server, timeout=5)
        sock.sendall(post_head(1_000_000) + b"[")
        return sock

    def _trickle(self) -> None:
        while not self.stop.wait(0.1):
            for i, sock in enumerate(self.socks):
                try:
                    if not select.select([sock], [], [], 0)[0]:
                        sock.sendall(b"0")
                        continue
                    sock.settimeout(1)
                    answer = sock.recv(65536)
                    self.seen[status_of(answer)] += 1  # answered (or closed: status 0)
                    self.named += b"--min-body-rate-kb" in answer
                except OSError:
                    self.seen[0] += 1
                sock.close()
                self.socks[i] = self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for sock in self.socks:
            sock.close()


def test_a_slow_body_flood_cannot_starve_infer(bounded, trained_run):
    """8 trickling bodies hold the cap (--max-connections 8) and take back each slot they lose at once: every
    probe and infer sent meanwhile is answered on its first try, the infer with 200 within httpx's 3 s (the old
    server: 503 at once for the flood's whole --body-timeout), because a body below --min-body-rate-kb is
    closed (408) to make room for a new connection."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    evicted = bounded.metric("torchcls_connections_closed_total", reason="evicted_body")
    flood = BodyFlood(bounded, 8)
    try:
        for _ in range(3):
            time.sleep(0.3)  # the flood holds all 8 slots again
            r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=3)
            assert r.status_code == 200, r.text
            for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
                assert httpx.get(f"{bounded.url}{path}", timeout=3).status_code == 200, path
        deadline = time.monotonic() + 5  # the flood's thread notices its closed connections within 0.1 s
        while sum(flood.seen.values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        flood.close()
    # Each infer found the cap full and made room by closing a flood connection, which was told why. A flood
    # connection that sends its next byte as the 408 arrives gets a reset, which discards the unread 408:
    # so at least one 408 naming the rate (not all three) is certain to be read.
    assert bounded.metric("torchcls_connections_closed_total", reason="evicted_body") >= evicted + 3
    assert sum(flood.seen.values()) >= 3 and flood.seen[408] >= 1 and flood.named >= 1, flood.seen


def test_a_burst_beyond_the_cap_is_served_up_to_the_cap(bounded, trained_run):
    """10 connections opened at once against --max-connections 8, then a real infer on each: the 8 that hold
    a slot are answered 200 (the old server answered all 10 with 503: each saw 10 open > 8)."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    body = httpx.Request("POST", "/", json=infer_body(x)).content
    socks = [connect(bounded) for _ in range(10)]
    time.sleep(0.3)  # all 10 admitted: 8 slots and 2 on the reserve, none has sent a byte yet
    for sock in socks:
        sock.sendall(post_head(len(body)) + body)
    statuses = Counter(status_of(sock.recv(65536)) for sock in socks)
    for sock in socks:
        sock.close()
    assert statuses[200] >= 8 and set(statuses) <= {200, 503}, statuses


def test_a_body_below_the_minimum_rate_gets_408_and_a_stalled_honest_body_does_not(bounded, trained_run):
    """Below the cap: a body that stops after its first byte is closed with 408 after the 2 s grace, before
    --body-timeout (4 s); a body that sent half of itself at once and then stalls for 2.5 s has earned that
    pause (a second per KiB at the default 1 KiB/s) and is answered 200."""
    too_slow = bounded.metric("torchcls_connections_closed_total", reason="body_too_slow")
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    body = httpx.Request("POST", "/", json=infer_body(x)).content
    trickle, stalled = connect(bounded), connect(bounded)
    trickle.sendall(post_head(100_000) + b"[")
    stalled.sendall(post_head(len(body)) + body[:len(body) // 2])
    time.sleep(2.5)
    stalled.sendall(body[len(body) // 2:])
    answer = read_all(trickle)
    assert status_of(answer) == 408 and b"--min-body-rate-kb" in answer, answer
    assert status_of(stalled.recv(65536)) == 200
    stalled.close()
    assert bounded.metric("torchcls_connections_closed_total", reason="body_too_slow") == too_slow + 1


def test_a_client_leaving_mid_body_is_one_log_line_and_a_499(bounded):
    before = bounded.metric("torchcls_requests_total", status="499")
    gone = connect(bounded)
    gone.sendall(post_head(1_000_000) + b"0" * 1000)
    time.sleep(0.3)
    gone.close()
    assert bounded.wait_metric("torchcls_requests_total", before + 1, status="499") == before + 1
    assert bounded.metric("torchcls_requests_total", status="500") == 0
    log = bounded.log.read_text()
    assert "client went away after 1,000 of 1,000,000 body bytes" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log


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


def test_connections_answered_before_their_body_arrived_are_not_held(bounded, trained_run):
    """A probe declaring a 1-byte body is answered at once; the byte comes after the answer. The old server
    then held each such connection for ever (no deadline, in none of admission's groups): 8 + 64 of them
    starved it, a real infer was closed unread. Now each waits for its next headers like any idle one:
    closed to make room, and within --header-timeout."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    socks, statuses = [], Counter()
    for _ in range(8 + 64):  # one after the other: while its byte is missing, a body is behind (closed at the cap)
        s = connect(bounded, timeout=10)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n")
        statuses.update(read_responses(s, 1))
        s.sendall(b"x")
        socks.append(s)
    assert statuses[200] >= 8 + 60, statuses
    time.sleep(0.3)
    r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=5)
    assert r.status_code == 200, r.text
    assert sum(read_all(s) == b"" for s in socks) == len(socks)  # each closed (a socket timeout fails here)
    for s in socks:
        s.close()
    early = connect(bounded)  # an honest client: a 404 before its body, then its next request on that connection
    early.sendall(post_head(4000, "/v2/models/nope/infer"))
    assert read_responses(early, 1) == [404]
    early.sendall(b" " * 4000 + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_responses(early, 1) == [200]
    early.close()


def never_reading(server: LoggedServer) -> socket.socket:
    """A client with a 4 KiB receive window that pipelines ~6 MiB of requests, each answered with a 3 KiB 404
    (the kernel's send buffer on loopback grows to 4 MiB), and never reads a byte."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect(("127.0.0.1", server.port))
    request = b"GET /v2/models/%s HTTP/1.1\r\nHost: x\r\n\r\n" % (b"n" * 3000)
    threading.Thread(target=_send_quietly, args=(sock, request * 2000), daemon=True).start()
    return sock


def test_clients_that_never_read_are_cut_off_and_cannot_hold_a_slot(bounded, trained_run):
    """The old server waited for a client that never reads for ever (uvicorn's send() awaits the drain): with
    the cap full of them it answered every real infer 503. Now such a connection is aborted after
    --send-timeout (2 s), and at the cap it is closed to make room."""
    def cut() -> float:
        return sum(bounded.metric("torchcls_connections_closed_total", reason=r) for r in ("send_timeout", "evicted_send"))

    before = cut()
    reader = never_reading(bounded)
    deadline = time.monotonic() + 15
    while cut() < before + 1:
        assert time.monotonic() < deadline, "a client that never reads was held beyond --send-timeout"
        time.sleep(0.1)
    reader.close()
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    reader = never_reading(bounded)
    time.sleep(1.0)  # its answers fill the buffers: writing pauses
    holders = []
    for _ in range(7):  # with the reader: the cap, no body behind the minimum rate (16 KiB: 16 s of credit)
        h = connect(bounded)
        h.sendall(post_head(1_000_000) + b"[" * 16384)
        holders.append(h)
    time.sleep(0.3)
    r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=5)
    assert r.status_code == 200, r.text
    assert cut() >= before + 2
    for sock in (reader, *holders):
        sock.close()


def test_a_pipelining_flood_is_parsed_as_it_is_answered_and_pipelining_works(bounded, trained_run):
    """2 MiB of 32-byte pipelined GETs on one connection: the old server parsed every one it read and queued
    them (~8,000 per 256 KiB read, after each answer: +100s of MiB); now at most MAX_PIPELINE wait and the
    rest of what was read waits unparsed. A few pipelined requests, an infer with a body among them, are
    answered in order."""
    proc = psutil.Process(bounded.proc.pid)
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    body = httpx.Request("POST", "/", json=infer_body(x)).content
    few = connect(bounded)
    few.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" + post_head(len(body)) + body
                + b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_responses(few, 4) == [200, 200, 200, 404]
    few.close()
    rss_before = proc.memory_info().rss
    flood = connect(bounded, timeout=10)
    sender = threading.Thread(target=lambda: _send_quietly(flood, b"GET /v2/health/live HTTP/1.1\r\n\r\n" * 65536))
    sender.start()
    statuses = read_responses(flood, 600)
    rss_after = proc.memory_info().rss
    flood.close()
    sender.join()
    assert statuses == [200] * 600
    assert (rss_after - rss_before) / MiB < 30, (rss_before / MiB, rss_after / MiB)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # closed by the reader when it has read enough
        pass


def test_an_upgrade_request_is_answered_closed_and_logged_sparingly(bounded):
    """`Upgrade: h2c` (curl --http2 on http://): answered over HTTP/1.1 and closed; the old server kept the
    connection and logged 2 warnings for each later read of it."""
    before = bounded.log.read_text().count("nsupported upgrade")
    for _ in range(12):
        s = connect(bounded, timeout=10)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
        for _ in range(20):
            time.sleep(0.005)
            _send_quietly(s, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert status_of(read_all(s)) == 200
        s.close()
    assert bounded.log.read_text().count("nsupported upgrade") - before <= 2 * LOG_LINES_PER_S


class _Flow:  # a TimedFlow that never holds: every second counts
    holding = False

    def held_s(self, now: float) -> float:
        return 0.0


class _Body:
    def __init__(self, pace: BodyPace):
        self.pace = pace

    def evict(self) -> None:
        raise AssertionError("none is behind")


def test_a_new_connection_at_the_cap_does_not_look_at_every_body_that_keeps_up(monkeypatch):
    """1,024 bodies ahead of the minimum rate: finding none behind looked at all 1,024 for each new connection
    (thousands of connections a second saturated the loop); now each is looked at again only when it could be
    behind."""
    conns = Connections(ConnectionLimits(1024, 16384, 10, 60, min_body_rate=1024), lambda reason: None)
    now = time.monotonic()
    for _ in range(1024):
        body = _Body(BodyPace(_Flow(), now))
        body.pace.received = 10 * 1024  # 10 s ahead
        conns.open.add(body)
        conns.receiving(body)
    looked = Counter()
    behind = BodyPace.behind
    monkeypatch.setattr(BodyPace, "behind", lambda pace, *a: looked.update([id(pace)]) or behind(pace, *a))
    for _ in range(1000):
        assert conns._victim() is None
    assert sum(looked.values()) <= 1024, sum(looked.values())  # the old walk: 1,024,000


TRITON_CLIENT = """
import sys, numpy as np, tritonclient.http as tc
client = tc.InferenceServerClient(sys.argv[1])
x = np.load(sys.argv[2])
inp = tc.InferInput("input", list(x.shape), "FP32")
inp.set_data_from_numpy(x, binary_data=True)
asked = client.infer("shapes", [inp], outputs=[tc.InferRequestedOutput("logits", binary_data=True),
                                                tc.InferRequestedOutput("labels", binary_data=False)])
default = client.infer("shapes", [inp])  # no outputs named: tritonclient asks for binary_data_output
for name, r in (("asked", asked), ("default", default)):
    for out in r.get_response()["outputs"]:
        print(name, out["name"], "binary" if "binary_data_size" in out.get("parameters", {}) else "json")
np.save(sys.argv[3], asked.as_numpy("logits"))
print("labels", [b.decode() if isinstance(b, bytes) else b for b in default.as_numpy("labels").tolist()])
"""


@pytest.mark.skipif(importlib.util.find_spec("tritonclient") is None, reason="tritonclient[http] (test extra)")
def test_tritonclient_gets_binary_outputs(bounded, trained_run, tmp_path):
    import numpy as np

    from torchcls.checkpoint.files import load_model

    _, meta = load_model(trained_run)
    x = preprocessed(trained_run, [f for f, _ in images_of(trained_run)[::9]][:3])
    np.save(tmp_path / "x.npy", x.numpy())
    # Its own process: tritonclient.http imports gevent, which should not share the test process.
    r = subprocess.run([sys.executable, "-c", TRITON_CLIENT, f"127.0.0.1:{bounded.port}", str(tmp_path / "x.npy"),
                        str(tmp_path / "logits.npy")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert {"asked logits binary", "asked labels json", "default logits binary", "default probabilities binary",
            "default labels binary"} <= set(lines), r.stdout
    # Against the same server's JSON answer for the same batch: whatever precision it serves in, the
    # binary bytes must decode to exactly those numbers and labels.
    out = {o["name"]: o for o in httpx.post(f"{bounded.url}{INFER}", json=infer_body(x)).json()["outputs"]}
    expected = torch.tensor(out["logits"]["data"]).reshape(3, -1)
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "logits.npy")), expected)
    assert f"labels {out['labels']['data']}" in lines and set(out["labels"]["data"]) <= set(meta.classes)

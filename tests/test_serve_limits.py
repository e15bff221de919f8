"""The app's own bounds in `torchcls serve` against slow, large and vanishing clients, over real sockets.

One real server with short deadlines (--header-timeout 1.5, --body-timeout 10, --send-timeout 2) and small
caps (--max-header-kb 4, --max-connections 8, --max-inflight-mb 64): complete oversized headers get 431 from
the app, a body that does not fit the in-flight budget gets 503 before it is read, 31 MiB parse bombs are
refused at a small CPU cost while a normal infer is answered, the probes are answered while --max-connections
requests are in progress, slow bodies get 408 for their rate, a client leaving mid-body is a 499 with one log
line, a client that never reads is cut from the app after --send-timeout, pipelining works and a pipelining
flood holds nothing, and binary outputs reach the real tritonclient as binary. Hypercorn's own bounds (idle
and trickling clients, unfinished header blocks, h2c) are in tests/test_serve_hypercorn_bounds.py.

No test measures how long a bound took: each waits for the server's /metrics counter (or its answer, or its
socket) under a generous overall timeout.
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
from serve_clients import (  # noqa: E402
    INFER,
    PATIENCE_S,
    LoggedServer,
    MiB,
    connect,
    holding_bodies,
    never_reading,
    post_head,
    read_all,
    read_responses,
    send_quietly,
    status_of,
    wait_until,
)
from test_serve import images_of, infer_body, preprocessed  # noqa: E402

pytestmark = pytest.mark.slow
SEND_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def bounded(trained_run, tmp_path_factory):
    s = LoggedServer(trained_run, tmp_path_factory.mktemp("bounds") / "serve.log", "--header-timeout", "1.5",
                     "--body-timeout", "10", "--max-header-kb", "4", "--max-connections", "8",
                     "--max-body-mb", "32", "--max-inflight-mb", "64", "--max-batch", "8", "--send-timeout",
                     str(SEND_TIMEOUT_S), "--graceful-timeout", "1")  # never-reading clients hold the drain to its end
    yield s
    assert s.stop() == 0


def test_complete_oversized_headers_get_431_from_the_app(bounded):
    """A complete header block above --max-header-kb that arrives in one read, and 101 short header lines
    (under 4 KiB): 431 with a JSON error naming the bound, counted header_too_large; 3 KB of headers pass."""
    before = bounded.closed("header_too_large")
    big = connect(bounded)
    big.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 6000 + b"\r\n\r\n")
    answer = read_all(big)
    assert status_of(answer) == 431 and b"--max-header-kb" in answer, answer
    many = connect(bounded)
    many.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101))
                 + b"\r\n")
    answer = read_all(many)
    assert status_of(answer) == 431 and b"header lines" in answer, answer
    assert bounded.wait_metric("torchcls_connections_closed_total", before + 2, reason="header_too_large") == before + 2
    ok = httpx.get(f"{bounded.url}/v2/health/live", headers={"X-Fine": "b" * 3000})  # under the cap
    assert ok.status_code == 200


def test_a_body_that_stops_gets_408_at_the_body_timeout(bounded):
    """A body that stops after 16 KiB (18 s of credit at the default 1 KiB/s): 408 naming --body-timeout (10 s),
    counted body_timeout; the server keeps answering."""
    before = bounded.closed("body_timeout")
    slow_body = connect(bounded)
    slow_body.sendall(post_head(100_000) + b"[" * 16384)
    answer = read_all(slow_body)
    assert status_of(answer) == 408 and b"--body-timeout" in answer, answer
    assert re.search(rb"connection: close", answer, re.I)
    assert bounded.wait_metric("torchcls_connections_closed_total", before + 1, reason="body_timeout") == before + 1
    assert bounded.wait_metric("torchcls_requests_total", 1, status="408") >= 1
    assert httpx.get(f"{bounded.url}/v2/health/live").status_code == 200


def test_bodies_share_one_budget_and_a_declared_body_that_does_not_fit_is_refused_unread(bounded):
    """Two clients hold 30 MiB each of a 64 MiB budget; a third declaring 31 MiB gets 503 at once."""
    gone_before = bounded.metric("torchcls_requests_total", status="499")
    holders = []
    for _ in range(2):  # each connected just before its send: an idle one waiting past --header-timeout is closed
        holders.append(connect(bounded))
        holders[-1].sendall(post_head(31 * MiB) + b" " * (30 * MiB))
    assert bounded.wait_metric("torchcls_inflight_body_bytes", 60 * MiB) >= 60 * MiB
    third = connect(bounded)
    third.sendall(post_head(31 * MiB))  # no body byte sent: the answer comes before any is read
    answer = read_all(third)
    assert status_of(answer) == 503 and b"--max-inflight-mb" in answer
    assert re.search(rb"retry-after: 1", answer, re.I)
    for h in holders:  # mid-body disconnects: 499, the bytes are given back
        h.close()
    wait_until(lambda: bounded.metric("torchcls_inflight_body_bytes") == 0, "the held body bytes given back")
    assert bounded.wait_metric("torchcls_requests_total", gone_before + 2, status="499") == gone_before + 2
    assert bounded.metric("torchcls_requests_total", status="500") == 0


def test_many_large_bodies_stay_within_the_budget(bounded):
    """8 concurrent 31 MiB bodies: the server's peak RSS grows by about the budget, not 8 x 31 MiB x 2, and at
    least two of them (64 MiB) are read to their end and answered."""
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
    assert set(codes) <= {400, 503, 0}, codes  # 400: too many values for the shape
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{bounded.proc.pid}/status").read_text()).group(1)) * 1024
    assert (peak - rss_before) / MiB < 200, (rss_before / MiB, peak / MiB)  # the old server: > 500 MiB
    # Progress: the first bodies that fit the budget together are read to their end (serve/limits.py
    # InflightBudget); refusing whichever body's chunk did not fit had cut all 8 mid-body.
    assert codes.count(400) >= 2, codes


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


def test_probes_are_answered_while_max_connections_requests_are_in_progress(bounded, trained_run):
    """8 infer bodies in progress (16 KiB of 1 MB each: 18 s of rate credit, --body-timeout 10): the cap. A 9th
    infer gets 503 at once, with Retry-After, counted over_capacity; the probes and /metrics get 200. When the
    8 leave (499 each), an infer is answered again."""
    x = torch.zeros(1, 3, 32, 32)
    over, gone = bounded.closed("over_capacity"), bounded.metric("torchcls_requests_total", status="499")
    cut = bounded.closed("body_timeout") + bounded.closed("body_too_slow")
    holders = holding_bodies(bounded, 8)
    try:
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
            assert httpx.get(f"{bounded.url}{path}", timeout=PATIENCE_S).status_code == 200, path
        r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=PATIENCE_S)
        assert r.status_code == 503 and "--max-connections" in r.json()["error"], r.text
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert bounded.closed("over_capacity") == over + 1
        assert bounded.closed("body_timeout") + bounded.closed("body_too_slow") == cut  # all 8 in progress
    finally:
        for h in holders:
            h.close()
    assert bounded.wait_metric("torchcls_requests_total", gone + 8, status="499") == gone + 8
    assert httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=PATIENCE_S).status_code == 200


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


def test_a_slow_body_flood_below_the_cap_cannot_starve_infer(bounded, trained_run):
    """6 trickling bodies (10 B/s, --min-body-rate-kb 1) reopened as soon as they are answered, under
    --max-connections 8: each is cut with 408 naming --min-body-rate-kb (body_too_slow) once its 2 s of grace
    are spent, and every infer and probe sent meanwhile is answered 200."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    too_slow = bounded.closed("body_too_slow")
    flood = BodyFlood(bounded, 6)
    try:
        while bounded.closed("body_too_slow") < too_slow + 6 or sum(flood.seen.values()) < 3:
            r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=PATIENCE_S)
            assert r.status_code == 200, r.text
            for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
                assert httpx.get(f"{bounded.url}{path}", timeout=PATIENCE_S).status_code == 200, path
            assert flood.thread.is_alive()
    finally:
        flood.close()
    # A flood connection that sends its next byte as the 408 arrives gets a reset, which discards the unread
    # 408: so at least one 408 naming the rate (not all) is certain to be read.
    assert flood.seen[408] >= 1 and flood.named >= 1 and set(flood.seen) <= {408, 0}, flood.seen


def test_a_slow_body_flood_at_the_cap_cannot_starve_infer(bounded, trained_run):
    """16 trickling bodies against --max-connections 8: at the cap a new request cuts the body furthest behind
    the minimum rate (408, counted evicted_body), so a client that honours Retry-After is answered within 15
    tries, however fast the flood takes back what it loses."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    evicted = bounded.closed("evicted_body")
    flood, statuses = BodyFlood(bounded, 16), Counter()
    try:
        while statuses[200] == 0 and sum(statuses.values()) < 15:
            r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(x), timeout=PATIENCE_S)
            statuses[r.status_code] += 1
            if r.status_code == 503:
                time.sleep(float(r.headers["retry-after"]))  # the client's pace, as the server asks
    finally:
        flood.close()
    assert statuses[200] >= 1, statuses
    assert bounded.closed("evicted_body") > evicted


def test_a_burst_beyond_the_cap_is_served_up_to_the_cap(bounded, trained_run):
    """10 infer requests sent at once against --max-connections 8: a refusal (503) means 8 others were in
    progress, each answered 200: at least 8 are answered."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    body = httpx.Request("POST", "/", json=infer_body(x)).content
    socks = [connect(bounded) for _ in range(10)]
    for sock in socks:
        sock.sendall(post_head(len(body)) + body)
    statuses = Counter(status_of(sock.recv(65536)) for sock in socks)
    for sock in socks:
        sock.close()
    assert statuses[200] >= 8 and set(statuses) <= {200, 503}, statuses


def test_a_body_below_the_minimum_rate_gets_408_and_a_stalled_honest_body_does_not(bounded, trained_run):
    """A body that stops after its first byte is cut with 408 naming --min-body-rate-kb once its 2 s of grace
    are spent (before --body-timeout 10); a body that sent half of itself (~30 KiB: 30 s of credit) and then
    stalls until that 408 has come has earned the pause, and is answered 200 when the rest comes."""
    too_slow = bounded.closed("body_too_slow")
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    body = httpx.Request("POST", "/", json=infer_body(x)).content
    trickle, stalled = connect(bounded), connect(bounded)
    trickle.sendall(post_head(100_000) + b"[")
    stalled.sendall(post_head(len(body)) + body[:len(body) // 2])
    answer = read_all(trickle)  # the stalled body waits as long as this takes
    assert status_of(answer) == 408 and b"--min-body-rate-kb" in answer, answer
    stalled.sendall(body[len(body) // 2:])
    assert status_of(stalled.recv(65536)) == 200
    stalled.close()
    assert bounded.wait_metric("torchcls_connections_closed_total", too_slow + 1, reason="body_too_slow") == too_slow + 1


def test_a_client_leaving_mid_body_is_one_log_line_and_a_499(bounded):
    before = bounded.metric("torchcls_requests_total", status="499")
    held = bounded.metric("torchcls_inflight_body_bytes")
    gone = connect(bounded)
    gone.sendall(post_head(1_000_000) + b"0" * 1000)
    assert bounded.wait_metric("torchcls_inflight_body_bytes", held + 1000) >= held + 1000  # the app has them
    gone.close()
    assert bounded.wait_metric("torchcls_requests_total", before + 1, status="499") == before + 1
    assert bounded.metric("torchcls_requests_total", status="500") == 0
    log = bounded.log.read_text()
    assert log.count("client went away after 1,000 of 1,000,000 body bytes") == 1
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_a_client_that_never_reads_is_cut_from_the_app_but_hypercorn_keeps_its_connection(bounded):
    """What is bounded, and what no public option bounds. A client with a 4 KiB window pipelines 3 KiB 404s and
    reads none. The app's send() waits at most --send-timeout (2 s): then the request ends (send_timeout,
    counted 408 in requests_total, one log line) and gives back its --max-connections slot. Hypercorn's own
    closing write of the bytes it already buffered (asyncio's transport.close() flushes first) has no deadline
    and no public setting: the server keeps that connection ESTABLISHED until the client reads or leaves.
    If a Hypercorn upgrade gives its writes a deadline, this test fails: then cite that setting here and in
    docs/security.md."""
    before = bounded.closed("send_timeout")
    reader = never_reading(bounded)
    port = reader.getsockname()[1]
    try:
        assert bounded.wait_metric("torchcls_connections_closed_total", before + 1, reason="send_timeout") == before + 1
        assert bounded.holds(port)
        holders = holding_bodies(bounded, 7)  # the reader's slot was given back: 7 + 1 fit under the cap
        try:
            r = httpx.post(f"{bounded.url}{INFER}", json=infer_body(torch.zeros(1, 3, 32, 32)), timeout=PATIENCE_S)
            assert r.status_code == 200, r.text
        finally:
            for h in holders:
                h.close()
        # Twice each of the server's timers later (header, send; body not running: no request in progress)
        time.sleep(2 * (1.5 + SEND_TIMEOUT_S))  # a wait for something that must not happen: no latency asserted
        assert bounded.holds(port), "Hypercorn closed it: its writes now have a deadline (see the docstring)"
        assert bounded.closed("send_timeout") == before + 1  # one request cut; nothing more of it ran
    finally:
        reader.close()
    wait_until(lambda: not bounded.holds(port), "the connection released once its client left")
    assert "send_timeout after" in bounded.log.read_text()


def test_a_pipelining_flood_is_parsed_as_it_is_answered_and_pipelining_works(bounded, trained_run):
    """A few pipelined requests, an infer with a body among them, are answered in order. 2 MiB of 32-byte
    pipelined GETs on one connection: Hypercorn parses the next request only once the one before is answered
    (h11 pauses), so the server's RSS does not grow with the flood (the old uvicorn server: +100s of MiB)."""
    proc = psutil.Process(bounded.proc.pid)
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    body = httpx.Request("POST", "/", json=infer_body(x)).content
    few = connect(bounded)
    few.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" + post_head(len(body)) + body
                + b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_responses(few, 4) == [200, 200, 200, 404]
    few.close()
    rss_before = proc.memory_info().rss
    flood = connect(bounded)
    sender = threading.Thread(target=lambda: send_quietly(flood, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * 50000))
    sender.start()
    statuses = read_responses(flood, 600)
    rss_after = proc.memory_info().rss
    flood.close()
    sender.join()
    assert statuses == [200] * 600
    assert (rss_after - rss_before) / MiB < 30, (rss_before / MiB, rss_after / MiB)


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

"""`torchcls serve --probe-port`: the health probes and /metrics on a port, thread and event loop of their own.

One real server on 127.0.0.1 with a small --max-connections and --model-process (its warm-up waits seconds
for the model process to import torch: a window in which ready must say 400 on the probe port): the probe
port answers before the model is ready, while slow bodies hold every API request slot, while its own connections
are flooded with slowloris (closed silently after its 2 s header timeout, Hypercorn's), and stops with the
server; /metrics there needs the token, as on the API port.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
from serve_clients import metric_value  # noqa: E402
from test_serve import free_port, infer_body  # noqa: E402

pytestmark = pytest.mark.slow
PROBES = ("/v2/health/live", "/v2/health/ready", "/metrics")
AUTH = {"Authorization": "Bearer probe-secret"}  # /metrics needs the token on both ports, the probes never
BOUND_S = 5.0  # a probe's timeout, generous (kubelet: 1 s): a probe the API's load could delay is what --probe-port is for


class ProbedServer:
    """The server, its log in a file; `ready_seen`: the probe port's /v2/health/ready statuses until the first 200."""

    def __init__(self, artifact: Path, log: Path, *flags: str):
        self.port, self.probe_port, self.log = free_port(), free_port(), log
        self.url, self.probe_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.probe_port}"
        self.out = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "torchcls", "serve", str(artifact), "--port",
                                      str(self.port), "--probe-port", str(self.probe_port), "--threads", "1", *flags],
                                     stdout=self.out, stderr=subprocess.STDOUT)
        self.ready_seen, self.live_before_ready = [], []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.ready_seen.append(httpx.get(f"{self.probe_url}/v2/health/ready", timeout=2).status_code)
                if self.ready_seen[-1] == 200:
                    return
                self.live_before_ready.append(httpx.get(f"{self.probe_url}/v2/health/live", timeout=2).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"server did not become ready: {log.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.out.close()

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(httpx.get(f"{self.probe_url}/metrics", headers=AUTH).text, name, **labels)


@pytest.fixture(scope="module")
def probed(trained_run, tmp_path_factory):
    s = ProbedServer(trained_run, tmp_path_factory.mktemp("probes") / "serve.log", "--model-process",
                     "--max-connections", "4", "--header-timeout", "30", "--max-batch", "8", "--token", "probe-secret")
    yield s
    s.stop()


def probe(url: str) -> tuple[int, str]:
    """GET as a Kubernetes probe does: an answer not in within its timeout (BOUND_S) is a failed probe."""
    r = httpx.get(url, timeout=BOUND_S, headers=AUTH if url.endswith("/metrics") else None)
    return r.status_code, r.text


def slowloris(port: int, n: int) -> list[socket.socket]:
    """n connections that each send part of a request line and nothing more."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        socks.append(s)
    return socks


def test_ready_is_400_on_the_probe_port_until_the_model_has_warmed_up(probed):
    assert probed.ready_seen[0] == 400 and probed.ready_seen[-1] == 200, probed.ready_seen
    assert probed.live_before_ready and set(probed.live_before_ready) == {200}


def test_probes_are_answered_on_the_probe_port_while_slow_clients_hold_the_api(probed):
    """4 infer bodies in progress hold all 4 API request slots (--max-connections 4: an infer gets 503, counted
    over_capacity) and 40 slowloris connections wait on the API port: every probe on the probe port is 200."""
    over = probed.metric("torchcls_connections_closed_total", reason="over_capacity")
    held = probed.metric("torchcls_inflight_body_bytes")
    holders = []
    try:
        for _ in range(4):
            h = socket.create_connection(("127.0.0.1", probed.port), timeout=10)
            # 16 KiB of a 1 MB body: 18 s of credit at --min-body-rate-kb's 1 KiB/s, --body-timeout 60
            h.sendall(b"POST /v2/models/shapes/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer probe-secret\r\nContent-Length: 1000000\r\n\r\n" + b"[" * 16384)
            holders.append(h)
        holders += slowloris(probed.port, 40)
        deadline = time.monotonic() + 30  # until the app has taken in the 4 bodies' bytes: 4 requests in progress
        while probed.metric("torchcls_inflight_body_bytes") < held + 4 * 16384:
            assert time.monotonic() < deadline, "the 4 bodies were never read"
            time.sleep(0.05)
        r = httpx.post(f"{probed.url}/v2/models/shapes/infer", json=infer_body(torch.zeros(1, 3, 32, 32)),
                       headers=AUTH, timeout=30)
        assert r.status_code == 503 and "--max-connections" in r.json()["error"], r.text  # the API is at its cap
        for path in PROBES:
            status, text = probe(f"{probed.probe_url}{path}")
            assert status == 200, (path, status)
        over_now = re.search(r'^torchcls_connections_closed_total\{reason="over_capacity"\} (\S+)$', text, re.M)
        assert float(over_now.group(1)) == over + 1  # the API's count, read on the probe port
        assert "torchcls_queue_depth" in text and "torchcls_requests_total" in text
        assert httpx.get(f"{probed.probe_url}/metrics").status_code == 401  # the token rule of the API's port
    finally:
        for h in holders:
            h.close()


def test_the_probe_port_answers_nothing_else(probed):
    assert httpx.get(f"{probed.probe_url}/v2/models/shapes").status_code == 401  # the token first, as on --port
    assert httpx.get(f"{probed.probe_url}/v2/models/shapes", headers=AUTH).status_code == 404
    assert httpx.post(f"{probed.probe_url}/v2/models/shapes/infer", json={}, headers=AUTH).status_code == 404
    r = httpx.post(f"{probed.probe_url}/v2/health/ready")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_the_probe_port_bounds_its_own_connections(probed):
    """80 slowloris connections on the probe port: a probe still gets 200 (Hypercorn has no connection cap to
    fill), and each slow one is closed without a word by the port's 2 s header timeout (Hypercorn's keep-alive
    timer, which bytes do not restart: tests/test_serve_hypercorn_bounds.py guards its semantics)."""
    socks = slowloris(probed.probe_port, 80)
    try:
        assert probe(f"{probed.probe_url}/v2/health/ready")[0] == 200
        for s in socks:
            s.settimeout(30)  # far above the 2 s: a timeout fails the test
            assert s.recv(65536) == b""  # begun, then silent: closed, no 408
    finally:
        for s in socks:
            s.close()


def test_sigterm_closes_both_ports(probed):
    assert probed.stop() == 0
    for port in (probed.port, probed.probe_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    log = probed.log.read_text()
    assert f"also on http://127.0.0.1:{probed.probe_port}" in log and "Traceback" not in log


def test_probe_port_equal_to_port_or_busy_is_a_user_error(trained_run, capsys):
    from torchcls.cli import main

    port = free_port()
    assert main(["serve", str(trained_run), "--port", str(port), "--probe-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--probe-port {port} is --port's" in err and "Traceback" not in err, err
    interval = sys.getswitchinterval()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        try:
            code = main(["serve", str(trained_run), "--port", str(free_port()), "--probe-port",
                         str(busy.getsockname()[1])])
        finally:
            sys.setswitchinterval(interval)  # serve() set the server's
    err = capsys.readouterr().err
    assert code == 2 and "pick another --probe-port" in err and "Traceback" not in err, err

"""The bounds of `torchcls serve` that are Hypercorn's, not the app's: a guard that fails on a server upgrade.

No public ASGI message tells an app about a connection before its request's headers are complete, so the
bounds on that stage come from Hypercorn's public settings (serve/run_loop.py `hypercorn_config`):

- keep_alive_timeout = --header-timeout. Hypercorn's idle timer starts when a connection opens and after
  each answer, and stops when a request's headers are complete. Incoming bytes do not restart it: an
  idle, a silent and a trickling client are all closed --header-timeout after they opened (or after their
  last answer), silently (no 408: Hypercorn sends nothing), and a request whose headers are complete is
  never closed by it, however long its body or its model call takes.
- h11_max_incomplete_size = --max-header-kb. An unfinished request line + headers above it: Hypercorn
  answers 431 with an empty body and closes; the bytes it buffers meanwhile are that cap plus one read
  (64 KiB). A complete header block that arrived in one read reaches the app instead, which answers 431
  with a JSON error (tests/test_serve_limits.py).
- Hypercorn speaks cleartext HTTP/2 (h2c: `Upgrade: h2c` and prior knowledge) with no public option to
  turn it off: the Upgrade request is answered over HTTP/2 and the idle connection closed like any other.

If a Hypercorn upgrade changes any of this, a test here fails: re-read its keep-alive and h11 settings,
then fix serve/run_loop.py, docs/security.md and these tests together.
"""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
from serve_clients import (  # noqa: E402
    LoggedServer,
    MiB,
    connect,
    endless,
    post_head,
    read_all,
    read_responses,
    status_of,
    trickle_headers,
)
from test_serve import images_of, infer_body, preprocessed  # noqa: E402

pytestmark = pytest.mark.slow
HEADER_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def hyper(trained_run, tmp_path_factory):
    s = LoggedServer(trained_run, tmp_path_factory.mktemp("hyper") / "serve.log", "--header-timeout",
                     str(HEADER_TIMEOUT_S), "--body-timeout", "30", "--max-header-kb", "4", "--max-batch", "8")
    yield s
    assert s.stop() == 0


def test_hypercorn_bounds_we_rely_on_idle_silent_and_trickling_clients_are_closed_without_a_word(hyper):
    """A connection that sends nothing, one that sends half a request line, one that trickles a header line
    every 0.2 s (each line arrives well within --header-timeout: only a timer that incoming bytes do not
    restart closes it), and one idle after its answer: each is closed, with no answer but the one it had."""
    requests_before = hyper.metric("torchcls_requests_total")
    idle, silent, trickling = connect(hyper), connect(hyper), connect(hyper)
    silent.sendall(b"GET /v2/health/li")
    lines = trickle_headers(trickling)  # 150 lines (30 s) at most: closed long before, with --header-timeout 1.5
    assert lines < 150, "a trickling client was never closed (Hypercorn's keep-alive timer restarts on bytes?)"
    assert read_all(trickling) == b""  # Hypercorn closes without a 408: nothing of it reached the app
    assert read_all(idle) == b"" and read_all(silent) == b""  # a socket timeout (30 s) would fail here
    answered = connect(hyper)
    answered.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_responses(answered, 1) == [200]
    assert read_all(answered) == b""  # kept alive, then closed once idle for --header-timeout
    # Only the one answered request reached the app (and this test's /metrics scrape)
    assert hyper.metric("torchcls_requests_total") - requests_before == 2
    assert hyper.closed("header_too_large") == 0 and hyper.metric("torchcls_requests_total", status="408") == 0


def test_hypercorn_bounds_we_rely_on_the_idle_timer_stops_once_headers_are_complete(hyper, trained_run):
    """Headers, then half a body, then 2 x --header-timeout of silence (well within the body's rate credit and
    --body-timeout 30): answered 200, then more requests on the same connection. Hypercorn's idle timer does
    not run while a request is in progress."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    body = httpx.Request("POST", "/", json=infer_body(x)).content
    stalled = connect(hyper)
    stalled.sendall(post_head(len(body)) + body[:len(body) // 2])
    assert hyper.wait_metric("torchcls_inflight_body_bytes", len(body) // 2) >= len(body) // 2  # it is reading
    stalled.settimeout(2 * HEADER_TIMEOUT_S)
    with pytest.raises(TimeoutError):  # a client's pause, not a measurement: nothing must come meanwhile
        stalled.recv(1)
    stalled.settimeout(30)
    stalled.sendall(body[len(body) // 2:] + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_responses(stalled, 2) == [200, 200]
    stalled.close()


def test_hypercorn_bounds_we_rely_on_an_unfinished_header_block_is_refused_after_max_header_kb(hyper):
    """A header line, or a request line, that never ends (the old server buffered 64 MiB of it): Hypercorn
    answers 431 with an empty body and closes, having buffered --max-header-kb plus one 64 KiB read; the
    app's 431 (a JSON error, counted header_too_large) is for complete header blocks."""
    proc = psutil.Process(hyper.proc.pid)
    rss_before = proc.memory_info().rss
    for start in (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ", b"GET /v2/health/live?q="):
        sock = connect(hyper)
        sent = endless(sock, start)
        answer = read_all(sock)
        assert sent < 64 * MiB, "an endless header block was buffered without a bound"
        assert status_of(answer) in (431, 0), answer[:200]  # 0: the reset after it discarded the 431
        if answer:
            assert answer.endswith(b"\r\n\r\n") and b"content-length: 0" in answer.lower(), answer  # Hypercorn's
    assert (proc.memory_info().rss - rss_before) / MiB < 30
    assert hyper.closed("header_too_large") == 0  # not the app's: nothing reached it
    assert httpx.get(f"{hyper.url}/v2/health/live").status_code == 200


def test_hypercorn_answers_an_h2c_upgrade_over_http2_and_closes_it_when_idle(hyper):
    """`Upgrade: h2c` (curl --http2 on http://): 101, then the answer over HTTP/2 (a JSON body in a DATA frame);
    the connection, idle after its answer, is closed by the same timer. No traceback in the log."""
    for _ in range(3):
        s = connect(hyper)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                  b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\nPRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                  b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # the preface and an empty SETTINGS frame
        answer = read_all(s)  # until the idle timer closes it
        assert status_of(answer) == 101 and b'{"live":true}' in answer, answer[:300]
        s.close()
    log = hyper.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_hypercorn_bounds_we_rely_on_a_connection_answered_before_its_body_is_closed(hyper):
    """A probe declaring a 1-byte body, and an infer for an unknown model declaring 4,000: each is answered before
    its body arrives, and Hypercorn then closes the connection (its request is unfinished: h11 cannot start the
    next cycle), so no such connection is held waiting for a body nobody will read (the old server held each
    one for ever). The client's next request goes on a new connection."""
    for _ in range(20):
        s = connect(hyper)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n")
        assert read_responses(s, 1) == [200]
        assert read_all(s) == b""  # closed (a socket timeout fails here), the body byte never sent
        s.close()
    early = connect(hyper)
    early.sendall(post_head(4000, "/v2/models/nope/infer"))
    assert read_responses(early, 1) == [404]
    assert read_all(early) == b""
    early.close()
    assert httpx.get(f"{hyper.url}/v2/health/live").status_code == 200

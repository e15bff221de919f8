"""serve/deadlines.py on its own (no server, no sockets, fractions of a second): the body clock's budget, the
bytes of a request's head, and ClientDeadlines' requests cap, header bounds and send deadline."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcls.serve.deadlines import GRACE_S, MAX_HEADER_LINES, BodyClock, ClientDeadlines, RequestLimits
from torchcls.serve.limits import TIMED_OUT, ClientGone

LIMITS = RequestLimits(max_requests=2, max_header_bytes=4096, body_timeout=60.0, min_body_rate=1024.0,
                       send_timeout=0.05)


def test_a_body_clock_gives_the_grace_then_a_second_per_kib_and_never_beyond_the_deadline():
    clock = BodyClock(LIMITS, now=100.0)
    assert clock.allowance(100.0) == (GRACE_S, "body_too_slow")
    clock.received, clock.waited = 10 * 1024, 1.0  # 10 KiB in 1 s of waiting: 10 s of credit earned
    assert clock.allowance(101.0) == (pytest.approx(GRACE_S + 10 - 1.0), "body_too_slow")
    clock.received = 1000 * 1024  # far ahead of the rate: the deadline binds
    assert clock.allowance(150.0) == (pytest.approx(10.0), "body_timeout")
    assert clock.allowance(170.0) == (0.0, "body_timeout")  # past it: nothing left, never negative


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**7), st.floats(0, 100), st.floats(0, 100))
def test_seconds_the_server_was_not_waiting_never_count_against_a_body(received, waited, busy):
    """Only `waited` (time in receive()) is charged: the same body at a later wall-clock moment, the server busy
    meanwhile, keeps its rate allowance (only the absolute deadline moves closer)."""
    clock = BodyClock(RequestLimits(1, 4096, 1e9, 1024.0), now=0.0)
    clock.received, clock.waited = received, waited
    early, _ = clock.allowance(waited)
    late, _ = clock.allowance(waited + busy)
    assert late == pytest.approx(early) and early == max(0.0, GRACE_S + received / 1024.0 - waited)


def scope(path="/v2/models/m/infer", headers=(), method="POST"):
    return {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": [(b"host", b"x"), *headers]}


def run(middleware, sc, receive, sent):
    async def send(message):
        sent.append(message)

    asyncio.run(middleware(sc, receive, send))


def test_the_requests_cap_answers_503_beyond_it_and_never_counts_the_probes():
    cuts, gate, sent = [], None, []

    async def app(sc, receive, send):
        if sc["path"] == "/hold":
            await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = ClientDeadlines(app, LIMITS, cuts.append, exempt=frozenset({"/metrics"}))

    async def main():
        nonlocal gate
        gate = asyncio.Event()

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        held = [asyncio.ensure_future(mw(scope("/hold", method="GET"), receive, send)) for _ in range(2)]
        await asyncio.sleep(0)
        await mw(scope(), receive, send)  # a third request: 503
        await mw(scope("/metrics", method="GET"), receive, send)  # exempt: answered
        gate.set()
        await asyncio.gather(*held)
        assert mw.in_progress == 0

    asyncio.run(main())
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [503, 200, 200, 200] and cuts == ["over_capacity"]
    assert (b"retry-after", b"1") in sent[0]["headers"]


def test_too_many_header_lines_or_bytes_are_431_before_the_app():
    def app(*a):
        raise AssertionError("the app must not run")

    for headers in ([(b"x-%d" % i, b"1") for i in range(MAX_HEADER_LINES)], [(b"x-big", b"a" * 4096)]):
        cuts, sent = [], []
        run(ClientDeadlines(app, LIMITS, cuts.append, frozenset()), scope(headers=headers), None, sent)
        assert sent[0]["status"] == 431 and cuts == ["header_too_large"]


def test_a_send_that_waits_beyond_the_send_timeout_ends_the_request():
    cuts, sc = [], scope(method="GET")

    async def app(sc, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * 10})

    async def main():
        async def stuck_send(message):
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()  # the client never reads

        with pytest.raises(ClientGone):
            await ClientDeadlines(app, LIMITS, cuts.append, frozenset())(sc, None, stuck_send)

    asyncio.run(main())
    assert cuts == ["send_timeout"] and sc[TIMED_OUT] == "send_timeout"

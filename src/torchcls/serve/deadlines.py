"""The per-request bounds of `torchcls serve` that are the app's, through the ASGI API alone.

The HTTP server (Hypercorn, serve/server.py) bounds what happens before a request reaches the app:
an idle or slowly trickling connection is closed --header-timeout after it opened or after its last
answer (its keep-alive timer runs until a request's headers are complete), and an incomplete request
line + headers may buffer at most --max-header-kb. Everything after the headers is here, in one pure
ASGI middleware that sees only `scope`, `receive` and `send`:

- headers: at most --max-header-kb of them and MAX_HEADER_LINES lines in a request (431);
- requests at once: at most --max-connections requests in progress; at the cap a new request makes room
  by cutting the body furthest behind the minimum rate (408, no grace: a flood of slow bodies would take
  back every slot it loses), else it gets 503 at once, before any body is read; the health probes and
  /metrics are always answered. (On Python 3.10 nothing is cut: asyncio has no movable deadline there);
- body deadline: --body-timeout seconds from the headers to the end of the body (408, connection closed);
- minimum body rate (--min-body-rate-kb), as Apache's mod_reqtimeout `MinRate`: a budget of GRACE_S
  seconds plus one second per `min_rate` bytes received. Only the seconds in which the app waited in
  `receive()` count: while the app is busy (or has not asked yet) the server holds the bytes, and a client
  is never judged on the server's own delays;
- send deadline (--send-timeout): an answer the client does not read for that long ends the request;
- an answer that starts before the request's body is all in says `Connection: close` (RFC 9112 9.6).

A cut request is answered 408 (when nothing was sent yet) with `Connection: close`, counted in
torchcls_connections_closed_total{reason}, and reaches MetricsMiddleware as ClientGone (one log line).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from torchcls.serve.limits import GRACE_S, TIMED_OUT, ClientGone, send_error

MAX_HEADER_LINES = 100  # Apache's LimitRequestFields: each line costs a tuple of two bytes objects
# After GRACE_S (serve/limits.py) each KiB a body has sent buys it 1/--min-body-rate-kb more seconds.
# At --max-connections a body is cut to make room once it is this far behind the minimum rate: a trickling
# flood is, a moment after it opens; an honest body whose first bytes are on their way is not (it has
# waited a few milliseconds for nothing yet, and each KiB it sends puts it a second ahead).
EVICT_BEHIND_S = 0.1


EVICTABLE = sys.version_info >= (3, 11)  # asyncio.timeout's deadline can be moved: a waiting body can be cut


async def within(awaitable, seconds: float, clock: BodyClock | None = None):
    """`await awaitable`, or TimeoutError after `seconds`. From 3.11 on a deadline on the running task (no task
    of its own per call, as asyncio.wait_for creates: twice per request, under load), which `clock.evict()`
    brings forward to now."""
    if not EVICTABLE:
        return await asyncio.wait_for(awaitable, seconds)
    async with asyncio.timeout(seconds) as timer:
        if clock is not None:
            clock.timer = timer
        try:
            return await awaitable
        finally:
            if clock is not None:
                clock.timer = None


@dataclass(frozen=True)
class RequestLimits:
    max_requests: int  # in progress at once (--max-connections)
    max_header_bytes: int  # request line + headers (--max-header-kb)
    body_timeout: float  # seconds from the headers to the end of the body
    min_body_rate: float = 0.0  # bytes a second, averaged over the seconds spent waiting for them; 0 = none
    send_timeout: float = 30.0  # seconds one send may wait for the client to read


class _Cut(Exception):
    """A bound ended this request: `reason` is its torchcls_connections_closed_total label."""

    def __init__(self, reason: str, status: int, message: str):
        super().__init__(message)
        self.reason, self.status = reason, status


class BodyClock:
    """When a body has used up its time: the deadline from the headers, and the minimum-rate budget
    charged only with the seconds spent waiting in receive()."""

    def __init__(self, limits: RequestLimits, now: float):
        self.limits, self.deadline = limits, now + limits.body_timeout
        self.received, self.waited = 0, 0.0
        self.wait_began: float | None = None  # while waiting in receive()
        self.timer = None  # that wait's asyncio.timeout, while it lasts
        self.evicted = False

    def behind(self, now: float) -> float:
        """Seconds this body is behind the minimum rate, counting the wait in progress and no grace (> 0:
        slower than --min-body-rate-kb on average since its headers)."""
        if self.limits.min_body_rate <= 0:
            return 0.0
        waited = self.waited + (now - self.wait_began if self.wait_began is not None else 0.0)
        return waited - self.received / self.limits.min_body_rate

    def can_evict(self) -> bool:
        """Waiting now, and its deadline has not already fired (nor been moved by an earlier eviction)."""
        return self.timer is not None and not self.evicted and not self.timer.expired()

    def evict(self) -> None:
        """Cut the wait in progress now: its receive() raises TimeoutError, the request gets 408."""
        self.evicted = True
        self.timer.reschedule(asyncio.get_running_loop().time())

    def allowance(self, now: float) -> tuple[float, str]:
        """Seconds the next wait may last, and the reason if it runs out."""
        left, reason = self.deadline - now, "body_timeout"
        if self.limits.min_body_rate > 0:
            paced = GRACE_S + self.received / self.limits.min_body_rate - self.waited
            if paced < left:
                left, reason = paced, "body_too_slow"
        return max(left, 0.0), reason


def declares_body(scope) -> bool:
    """HTTP/1.1: a request has a body when it says Content-Length (other than 0) or Transfer-Encoding."""
    return any(k == b"transfer-encoding" or (k == b"content-length" and v.strip() != b"0") for k, v in scope["headers"])


def closing(message: dict) -> dict:
    """`message` (an http.response.start) with `Connection: close` in place of any Connection header."""
    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


def request_line_bytes(scope) -> int:
    """Bytes of the request line and headers as the client sent them (give or take separators)."""
    line = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string", b"")) + 16
    return line + sum(len(k) + len(v) + 4 for k, v in scope["headers"])


class ClientDeadlines:
    """Pure ASGI middleware applying RequestLimits; `exempt` paths (the probes) skip the requests cap."""

    def __init__(self, app, limits: RequestLimits, on_cut: Callable[[str], None], exempt: frozenset[str]):
        self.app, self.limits, self.on_cut, self.exempt = app, limits, on_cut, exempt
        self.in_progress = 0
        self.waiting: set[BodyClock] = set()  # bodies waiting in receive() now: the ones that can make room

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._admit(scope)
        except _Cut as cut:
            self.on_cut(cut.reason)
            return await send_error(send, cut.status, str(cut),
                                    [(b"retry-after", b"1")] if cut.status == 503 else [])
        counted = scope["path"] not in self.exempt
        self.in_progress += counted
        try:
            await self._run(scope, receive, send)
        finally:
            self.in_progress -= counted

    def _admit(self, scope) -> None:
        if len(scope["headers"]) > MAX_HEADER_LINES:
            raise _Cut("header_too_large", 431, f"more than {MAX_HEADER_LINES} header lines")
        if request_line_bytes(scope) > self.limits.max_header_bytes:
            raise _Cut("header_too_large", 431, f"request line and headers above {self.limits.max_header_bytes:,} "
                                                "bytes (--max-header-kb)")
        if scope["path"] not in self.exempt and self.in_progress >= self.limits.max_requests \
                and not self._make_room():
            raise _Cut("over_capacity", 503, f"the server has {self.in_progress} requests in progress, its limit "
                                             "(--max-connections); retry later")

    def _make_room(self) -> bool:
        """At the cap, cut the body furthest behind the minimum rate (no grace: a flood of slow bodies would
        otherwise take back every slot as soon as it frees); False if every body keeps up."""
        now = time.monotonic()
        behind = [(clock.behind(now), id(clock), clock) for clock in self.waiting if clock.can_evict()]
        if not behind or max(behind)[0] <= EVICT_BEHIND_S:
            return False
        max(behind)[2].evict()  # its request ends at once (408) and gives its slot back
        return True

    async def _run(self, scope, receive, send) -> None:
        clock, started, answered = BodyClock(self.limits, time.monotonic()), False, False
        body_done = not declares_body(scope)

        async def cut(reason: str, message: str):
            nonlocal answered
            scope[TIMED_OUT] = reason
            self.on_cut(reason)
            if not started:
                answered = True
                await send_error(send, 408, message)
            raise ClientGone(clock.received, None)

        async def timed_receive():
            nonlocal body_done
            if body_done:  # after the body: only a disconnect is left to hear, without a deadline
                return await receive()
            begun = clock.wait_began = time.monotonic()
            left, reason = clock.allowance(begun)
            self.waiting.add(clock)
            try:
                message = await within(receive(), left, clock)
            except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
                if clock.evicted:
                    await cut("evicted_body", f"request body slower than {self.limits.min_body_rate / 1024:g} KiB/s "
                                              "(--min-body-rate-kb) while the server was full (--max-connections)")
                # The answer names the option, as every refusal of the server does (a client's operator
                # reads it to tell a slow network from a bound set too tight).
                await cut(reason, f"request body slower than {self.limits.min_body_rate / 1024:g} KiB/s "
                                  "(--min-body-rate-kb)" if reason == "body_too_slow" else
                          f"request body not complete within {self.limits.body_timeout:g} s (--body-timeout)")
            finally:
                self.waiting.discard(clock)
                clock.wait_began = None
            clock.waited += time.monotonic() - begun
            if message["type"] == "http.request":
                clock.received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
            return message

        async def timed_send(message):
            nonlocal started
            if answered:  # a 408 went out already: later answers of the app have nobody to go to
                return
            if message["type"] == "http.response.start":
                started = True
                if not body_done:
                    # Answered before its body was read (401, 404, 503 and the like): Hypercorn closes the
                    # connection after the answer unless h11 happens to hold the whole body by then (it cannot
                    # start the next request mid-body). Say so: a pooled client that is not told sends its next
                    # request into the closing socket ("Server disconnected without sending a response").
                    message = closing(message)
            try:
                await within(send(message), self.limits.send_timeout)
            except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
                await cut("send_timeout", "the client did not read its answer")

        await self.app(scope, timed_receive, timed_send)

"""Guards in front of the app (pure ASGI, so they act before any body is read): body bytes, bearer token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

TIMED_OUT = "torchcls.timed_out"  # scope key: why serve/deadlines.py cut this request (-> 408)
# Before its first bytes can be judged, a body gets 2 s: several TCP retransmissions of a lost first
# segment (Linux's minimum RTO is 0.2 s, doubling), and the time a client may take between writing its
# headers and its body. Then it is held to its pace: the minimum rate (serve/deadlines.py), and the pace
# that keeps its place among the bodies entitled to wait for room (InflightBudget).
GRACE_S = 2.0


async def send_error(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = orjson.dumps({"error": message})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class ClientGone(Exception):
    """The client closed its connection before its request body was complete (or the body deadline
    closed it): nobody is left to answer. MetricsMiddleware logs it in one line and counts it apart."""

    def __init__(self, received: int, declared: int | None):
        super().__init__(f"after {received:,} of {'?' if declared is None else f'{declared:,}'} body bytes")
        self.received, self.declared = received, declared


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


@dataclass(eq=False)
class Body:
    """One request body in progress: its Content-Length (None when chunked), when its headers came, what arrived."""

    declared: int | None
    start: float
    received: int = 0


class InflightBudget:
    """Request body bytes that all connections hold at once (one event loop: no lock needed), and who gets
    room when there is none.

    Only bytes that arrived count, so holding N bytes of budget costs a client N bytes sent: a declared
    Content-Length reserves nothing (a reservation would let header-only connections, a few every GRACE_S,
    hold all of it for free). When a chunk does not fit, the bodies that came first and whose sizes fit the
    budget together ("entitled") wait up to GRACE_S for room while the others are refused at once (503),
    which gives it back: of 8 clients sending 31 MiB into 64 MiB the first two finish. (Refusing whichever
    body's chunk did not fit admitted all eight, cut every one of them mid-body, and nobody finished.) A
    body's size is its Content-Length, or `max_body` (--max-body-mb) when it is chunked; a body that falls
    behind the pace that would send that size within `pace_s` (--body-timeout) after GRACE_S is not entitled.
    """

    def __init__(self, limit: int, max_body: int, pace_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.max_body, self.pace_s, self.clock = limit, max_body, pace_s, clock
        self.used = 0
        self.bodies: dict[Body, None] = {}  # in progress, in the order their headers came
        self._freed: asyncio.Event | None = None  # set (and replaced) whenever bytes are given back

    def admit(self, declared: int | None) -> Body | None:
        """A new body; None when its Content-Length does not fit in what is left now (refused unread)."""
        if declared and self.used + declared > self.limit:
            return None
        body = Body(declared, self.clock())
        self.bodies[body] = None
        return body

    async def take(self, body: Body, n: int) -> bool:
        """Room for `n` more bytes of `body`; False when it is refused."""
        if self.used + n > self.limit:
            if not self.entitled(body):
                return False
            give_up = self.clock() + GRACE_S
            while self.used + n > self.limit:
                if self._freed is None:
                    self._freed = asyncio.Event()
                try:
                    await asyncio.wait_for(self._freed.wait(), give_up - self.clock())
                except asyncio.TimeoutError:
                    return False
        self.used += n
        body.received += n
        return True

    def release(self, body: Body) -> None:
        """The request was answered (or ended): its bytes come back, and the bodies waiting for room look again."""
        self.used -= body.received
        del self.bodies[body]
        if self._freed is not None and body.received:
            self._freed.set()
            self._freed = None

    def entitled(self, body: Body) -> bool:
        """`body` keeps its pace and fits with every body on pace that came before it."""
        now, total = self.clock(), 0
        for b in self.bodies:
            size = self.max_body if b.declared is None else b.declared
            if b.received < size * (now - b.start - GRACE_S) / self.pace_s:
                continue
            total += size
            if b is body:
                return total <= self.limit
        return False


class BodyGuard:
    """Every request body is counted as it arrives, against --max-body-mb (413) and against one budget
    shared by all connections, --max-inflight-mb (503 with Retry-After): the memory that bodies hold is
    bounded by the budget, not by connections x body size. A declared Content-Length that is above the
    limit, or that does not fit in what the budget has left now, is refused before any of the body is
    read. Who gets room when it is full is InflightBudget's rule. The bytes are given back when the request
    has been answered.
    """

    def __init__(self, app, max_bytes: int, budget: InflightBudget):
        self.app, self.max_bytes, self.budget = app, max_bytes, budget

    def _too_large(self) -> _Refused:
        return _Refused(413, f"request body above the server's limit of {self.max_bytes:,} bytes (--max-body-mb)")

    def _no_room(self, n: int) -> _Refused:
        return _Refused(503, f"the server holds {self.budget.used:,} of its {self.budget.limit:,} bytes of request "
                             f"bodies (--max-inflight-mb); {n:,} more do not fit now, retry later",
                        [(b"retry-after", b"1")])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > self.max_bytes:
            refusal = self._too_large()
            return await send_error(send, refusal.status, refusal.message)
        body = self.budget.admit(declared)
        if body is None:
            refusal = self._no_room(declared)
            return await send_error(send, refusal.status, refusal.message, refusal.headers)
        complete, started = False, False

        async def guarded_receive():
            nonlocal complete
            msg = await receive()
            if msg["type"] == "http.request":
                n = len(msg.get("body", b""))
                if body.received + n > self.max_bytes:
                    raise self._too_large()
                if not await self.budget.take(body, n):
                    raise self._no_room(n)
                complete = not msg.get("more_body", False)
            elif msg["type"] == "http.disconnect" and not complete:
                raise ClientGone(body.received, declared)
            return msg

        async def tracking_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except _Refused as r:
            if not started:
                await send_error(send, r.status, r.message, r.headers)
        finally:
            self.budget.release(body)


class AuthMiddleware:
    """401 unless `Authorization: Bearer <token>` matches (compared in constant time)."""

    def __init__(self, app, token: str, public: frozenset[str], compare: Callable[[bytes, bytes], bool]):
        self.app, self.expected, self.public, self.compare = app, f"Bearer {token}".encode(), public, compare

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not self.compare(given, self.expected):
            return await send_error(send, 401, "missing or wrong bearer token: send 'Authorization: Bearer TOKEN'",
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)

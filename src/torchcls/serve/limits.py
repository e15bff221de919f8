"""Guards in front of the app (pure ASGI, so they act before any body is read): body bytes, bearer token."""

from __future__ import annotations

from collections.abc import Callable

import orjson

TIMED_OUT = "torchcls.timed_out"  # scope key: why serve/deadlines.py cut this request (-> 408)


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


class InflightBudget:
    """Request body bytes held at once by all connections (one event loop: no lock needed)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class BodyGuard:
    """Every request body is counted as it arrives, against --max-body-mb (413) and against one budget
    shared by all connections, --max-inflight-mb (503 with Retry-After): the memory that bodies hold is
    bounded by the budget, not by connections x body size. A declared Content-Length that is above the
    limit, or that does not fit in what the budget has left now, is refused before any of the body is
    read. Only bytes that arrived are held (a slow client that declares a large body holds no more than
    it sent), and they are given back when the request has been answered.
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
        if declared and self.budget.used + declared > self.budget.limit:
            refusal = self._no_room(declared)
            return await send_error(send, refusal.status, refusal.message, refusal.headers)
        held, complete, started = 0, False, False

        async def guarded_receive():
            nonlocal held, complete
            msg = await receive()
            if msg["type"] == "http.request":
                n = len(msg.get("body", b""))
                if held + n > self.max_bytes:
                    raise self._too_large()
                if not self.budget.take(n):
                    raise self._no_room(n)
                held += n
                complete = not msg.get("more_body", False)
            elif msg["type"] == "http.disconnect" and not complete:
                raise ClientGone(held, declared)
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
            self.budget.give(held)


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

"""The HTTP/1.1 connection of `torchcls serve`: uvicorn's httptools protocol with the bounds it lacks.

uvicorn 0.54's `HttpToolsProtocol` (pinned in the 'serve' extra) has no header or body timeout (a
client that trickles one header line every few seconds holds its connection for ever), buffers a
request line and headers without limit (httptools concatenates a header that never ends), and
answers 503 to every request, health probes included, once `--max-connections` connections are
open, however idle they are. This subclass adds, before any byte reaches the parser:

- a header deadline (--header-timeout), armed when a connection opens and after each answer, so
  an idle or slowly trickling client is cut off (408 if it had begun a request); uvicorn's own
  5 s keep-alive timer still closes idle connections sooner;
- a cap on the bytes of a request line + headers (--max-header-kb) and on their count: bytes are
  fed to the parser in slices of at most the cap, so at most two slices are ever buffered (431);
- a body deadline (--body-timeout) from the end of the headers to the end of the body (408);
- admission by age: at --max-connections a new connection closes the one that has waited longest
  for the rest of its request headers (a slowloris), else the one open longest without sending a
  byte (once it has had FRESH_GRACE_S to send it: a new client's request is on its way), else the
  keep-alive connection idle longest since its last answer (a pooled client, which reconnects):
  none of them holds anything of value, and a client that has been served goes last. When none waits, up to
  RESERVE more are let in so that health probes and /metrics, which need no body and no model,
  are still answered (every other request beyond the cap gets a 503 at once).

Why a subclass of the httptools protocol and not h11 (`h11_max_incomplete_event_size` caps
headers): h11 has no header or body timeout either, and parses in Python at several times the
event loop's CPU per request; one subclass adds every bound in the one place where bytes arrive,
and tests/test_serve_limits.py drives each bound over real sockets against the pinned uvicorn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httptools
import orjson
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from torchcls.serve.limits import TIMED_OUT

PROBE_PATHS = frozenset({b"/v2/health/live", b"/v2/health/ready", b"/metrics"})
MAX_HEADER_LINES = 100  # Apache's LimitRequestFields: each line costs a tuple of two bytes objects
RESERVE = 64  # connections beyond --max-connections kept for probes when none can be evicted
FRESH_GRACE_S = 1.0  # a new connection is not evicted before it had this long to send its request


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout: float
    body_timeout: float


class _Connections:
    """Open connections of one server, and those waiting for request headers, oldest first, in the order
    they are evicted: `begun` have sent part of a request, `fresh` nothing since they opened, `served`
    nothing since their last answer."""

    def __init__(self, limits: ConnectionLimits, record: Callable[[str], None]):
        self.limits, self.record = limits, record
        self.open: set[GuardedProtocol] = set()
        self.begun: dict[GuardedProtocol, None] = {}  # insertion order = since when it waits
        self.fresh: dict[GuardedProtocol, float] = {}  # -> when it opened
        self.served: dict[GuardedProtocol, None] = {}

    def _victim(self) -> GuardedProtocol | None:
        if self.begun:
            return next(iter(self.begun))
        if self.fresh:
            oldest, since = next(iter(self.fresh.items()))
            if time.monotonic() - since > FRESH_GRACE_S:
                return oldest
        return next(iter(self.served), None)

    def admit(self, conn: GuardedProtocol) -> bool:
        if len(self.open) >= self.limits.max_connections:
            victim = self._victim()
            if victim is not None:
                self.drop(victim)
                victim.transport.close()
                self.record("evicted")
            elif len(self.open) >= self.limits.max_connections + RESERVE:
                self.record("refused")
                return False
        self.open.add(conn)
        return True

    def busy(self, conn: GuardedProtocol) -> None:
        """No longer waiting for request headers (not evictable)."""
        self.begun.pop(conn, None)
        self.fresh.pop(conn, None)
        self.served.pop(conn, None)

    def drop(self, conn: GuardedProtocol) -> None:
        self.open.discard(conn)
        self.busy(conn)


def raw_response(status: int, message: str) -> bytes:
    body = orjson.dumps({"error": message})
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\ncontent-length: ",
                     str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body])


class GuardedProtocol(HttpToolsProtocol):
    conns: _Connections  # set on the subclass that protocol_class() makes, one per server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers, self._header_bytes, self._header_lines = True, 0, 0
        self._refusal: tuple[int, str, str] | None = None
        super().connection_made(transport)
        if not self.conns.admit(self):
            transport.close()
            return
        self._await_headers(fresh=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.conns.drop(self)
        super().connection_lost(exc)

    # Deadlines
    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _await_headers(self, fresh: bool = False) -> None:
        conns = self.conns
        if fresh:
            conns.fresh[self] = time.monotonic()
        else:
            (conns.begun if self._header_bytes else conns.served)[self] = None
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.conns.limits.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._deadline = None
        begun = self._header_bytes > 0
        self._close(408 if begun else None, "header_timeout",
                    f"the request headers did not arrive within {self.conns.limits.header_timeout:g} s "
                    "(--header-timeout)")

    def _body_late(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            self._close(None, "body_timeout", "")
            return
        cycle.scope[TIMED_OUT] = True  # type: ignore[typeddict-unknown-key]  # read by MetricsMiddleware
        self._close(None if cycle.response_started else 408, "body_timeout",
                    f"the request body did not arrive within {self.conns.limits.body_timeout:g} s "
                    "of its headers (--body-timeout)")

    def _close(self, status: int | None, reason: str, message: str) -> None:
        if self.transport.is_closing():
            return
        self.conns.drop(self)
        self.conns.record(reason)
        if status is not None:
            self.transport.write(raw_response(status, message))
        self.transport.close()

    # Bytes in: the header cap is checked before each slice reaches the parser
    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        conns = self.conns
        if self._in_headers and not self._header_bytes and (self in conns.fresh or self in conns.served):
            conns.busy(self)  # its first byte: it has begun (a slowloris, if it stays)
            conns.begun[self] = None
        step = self.conns.limits.max_header_bytes
        for offset in range(0, len(data), step):
            if self.transport.is_closing():
                return
            if self._in_headers:
                if self._header_bytes >= step:
                    return self._too_large(f"above the server's limit of {step:,} bytes (--max-header-kb)")
                self._header_bytes += min(step, len(data) - offset)
            try:
                self.parser.feed_data(data[offset:offset + step])
            except httptools.HttpParserUpgrade:
                self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError:
                if self._refusal is not None:
                    return self._close(*self._refusal)
                self.logger.warning("Invalid HTTP request received.")
                self.conns.drop(self)
                return self.send_400_response("Invalid HTTP request received.")
        if self._in_headers and self._header_bytes >= step:
            self._too_large(f"above the server's limit of {step:,} bytes (--max-header-kb)")

    def _too_large(self, what: str) -> None:
        self._close(431, "header_too_large", f"request line and headers {what}")

    # Parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_lines += 1
        if self._header_lines > MAX_HEADER_LINES:
            self._refusal = (431, "header_too_large", f"more than {MAX_HEADER_LINES} header lines")
            raise ValueError("too many header lines")  # stops the parser: data_received answers 431
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self.conns.busy(self)
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.conns.limits.body_timeout, self._body_late)
        # uvicorn's own check (limit_concurrency) counts connections already closed but not yet gone,
        # which a stream of evictions keeps above the cap: the count here is the admitted connections.
        # A probe never counts against it: it needs no body, no model, no thread.
        limit = self.conns.limits.max_connections
        over = (self.url.split(b"?", 1)[0] not in PROBE_PATHS
                and (len(self.conns.open) > limit or len(self.tasks) >= limit))
        if not over:
            return super().on_headers_complete()
        self.conns.record("over_capacity")
        app, self.app = self.app, service_unavailable  # uvicorn's 503 with connection: close
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        self._in_headers, self._header_bytes, self._header_lines = True, 0, 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing() and self._in_headers:
            self._await_headers()


def protocol_class(limits: ConnectionLimits, record: Callable[[str], None] = lambda reason: None
                   ) -> tuple[type[GuardedProtocol], Callable[[], int]]:
    """A protocol class for one server (uvicorn.Config(http=...)), and a function counting its open
    connections. `record(reason)` is called for each connection closed by a bound."""
    conns = _Connections(limits, record)
    cls = type("GuardedProtocol", (GuardedProtocol,), {"conns": conns})
    return cls, lambda: len(conns.open)

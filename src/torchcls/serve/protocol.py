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
  for the rest of its request headers (a slowloris), or else the one idle the longest (a pooled
  keep-alive client, which reconnects): neither holds anything of value. When none waits, up to
  RESERVE more are let in so that health probes and /metrics, which need no body and no model,
  are still answered (every other request beyond the cap gets uvicorn's 503).

Why a subclass of the httptools protocol and not h11 (`h11_max_incomplete_event_size` caps
headers): h11 has no header or body timeout either, and parses in Python at several times the
event loop's CPU per request; one subclass adds every bound in the one place where bytes arrive,
and tests/test_serve_limits.py drives each bound over real sockets against the pinned uvicorn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from torchcls.serve.limits import TIMED_OUT

PROBE_PATHS = frozenset({b"/v2/health/live", b"/v2/health/ready", b"/metrics"})
MAX_HEADER_LINES = 100  # Apache's LimitRequestFields: each line costs a tuple of two bytes objects
RESERVE = 64  # connections beyond --max-connections kept for probes when none can be evicted


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout: float
    body_timeout: float


class _Connections:
    """Open connections of one server, and those waiting for request headers, oldest first: `begun`
    have sent part of a request, `idle` nothing since they opened or since their last answer."""

    def __init__(self, limits: ConnectionLimits, record: Callable[[str], None]):
        self.limits, self.record = limits, record
        self.open: set[GuardedProtocol] = set()
        self.begun: dict[GuardedProtocol, None] = {}  # insertion order = since when it waits
        self.idle: dict[GuardedProtocol, None] = {}

    def admit(self, conn: GuardedProtocol) -> bool:
        if len(self.open) >= self.limits.max_connections:
            waiting = self.begun or self.idle
            if waiting:
                victim = next(iter(waiting))
                self.drop(victim)
                victim.transport.close()
                self.record("evicted")
            elif len(self.open) >= self.limits.max_connections + RESERVE:
                self.record("refused")
                return False
        self.open.add(conn)
        return True

    def drop(self, conn: GuardedProtocol) -> None:
        self.open.discard(conn)
        self.begun.pop(conn, None)
        self.idle.pop(conn, None)


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
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.conns.drop(self)
        super().connection_lost(exc)

    # Deadlines
    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _await_headers(self) -> None:
        (self.conns.begun if self._header_bytes else self.conns.idle)[self] = None
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
        if self._in_headers and not self._header_bytes and self in self.conns.idle:
            del self.conns.idle[self]  # its first byte: from idle to begun (a slowloris, if it stays)
            self.conns.begun[self] = None
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
        self.conns.begun.pop(self, None)
        self.conns.idle.pop(self, None)
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.conns.limits.body_timeout, self._body_late)
        if self.url.split(b"?", 1)[0] not in PROBE_PATHS:
            return super().on_headers_complete()
        # A probe never counts against --max-connections: it needs no body, no model, no thread.
        limit, self.limit_concurrency = self.limit_concurrency, None
        try:
            super().on_headers_complete()
        finally:
            self.limit_concurrency = limit

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

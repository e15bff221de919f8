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
- a body deadline (--body-timeout) from the end of the headers to the end of the body (408), and a
  minimum body rate (--min-body-rate-kb, serve/pace.py): a body that has not kept up with it after a
  2 s grace gets 408 without waiting for the deadline;
- admission (serve/admission.py): at --max-connections a new connection closes one that holds its
  slot without using it (a slowloris, a body behind the minimum rate, a connection silent since it
  opened, an idle keep-alive one); when none can be closed, up to RESERVE more are let in so that
  health probes and /metrics are still answered, and a request on one of them gets a slot when its
  headers are in (closing one then if it can) or a 503 at once.

Why a subclass of the httptools protocol and not h11 (`h11_max_incomplete_event_size` caps
headers): h11 has no header or body timeout either, and parses in Python at several times the
event loop's CPU per request; one subclass adds every bound in the one place where bytes arrive,
and tests/test_serve_limits.py drives each bound over real sockets against the pinned uvicorn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httptools
import orjson
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from torchcls.serve.admission import ConnectionLimits, Connections
from torchcls.serve.limits import TIMED_OUT
from torchcls.serve.pace import GRACE_S, BodyPace, TimedFlow

PROBE_PATHS = frozenset({b"/v2/health/live", b"/v2/health/ready", b"/metrics"})
MAX_HEADER_LINES = 100  # Apache's LimitRequestFields: each line costs a tuple of two bytes objects
MIN_CHECK_S = 0.1  # a body's pace is checked at most this often (as its slack nears 0 before a 408)


def raw_response(status: int, message: str) -> bytes:
    body = orjson.dumps({"error": message})
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\ncontent-length: ",
                     str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body])


class GuardedProtocol(HttpToolsProtocol):
    conns: Connections  # set on the subclass that protocol_class() makes, one per server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers, self._header_bytes, self._header_lines = True, 0, 0
        self._refusal: tuple[int, str, str] | None = None
        self.pace: BodyPace | None = None  # of the body being received
        self._body_end, self._task = 0.0, None
        super().connection_made(transport)
        self.flow = TimedFlow(transport)  # before any request uses uvicorn's
        self._app, self.app = self.app, self._tracked
        if not self.conns.admit(self):
            transport.close()
            return
        self._await_headers(fresh=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        cycle, task = self.cycle, self._task
        if cycle is not None and not cycle.more_body and not cycle.response_complete and task and not task.done():
            self.conns.orphan(task)  # its client left after sending the whole request, which still runs
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

    def _arm_body_check(self, now: float) -> None:
        wait = self._body_end - now
        if self.pace is not None:
            wait = min(wait, max(self.pace.slack_s(now, self.conns.limits.min_body_rate), MIN_CHECK_S))
        self._deadline = self.loop.call_later(max(wait, 0.0), self._check_body)

    def _check_body(self) -> None:
        self._deadline = None
        now = time.monotonic()
        if now >= self._body_end:
            self._cut_body("body_timeout", "body deadline passed",
                           f"the request body did not arrive within {self.conns.limits.body_timeout:g} s "
                           "of its headers (--body-timeout)")
        elif self.pace is not None and self.pace.slack_s(now, self.conns.limits.min_body_rate) <= 0:
            self._cut_body("body_too_slow", "body below the minimum rate",
                           f"{self._pace_words(now)} after its first {GRACE_S:g} s")
        else:
            self._arm_body_check(now)

    def _pace_words(self, now: float) -> str:
        return (f"the request body arrived at {self.pace.rate(now):,.0f} bytes/s, below the server's minimum of "
                f"{self.conns.limits.min_body_rate / 1024:g} KiB/s (--min-body-rate-kb)")

    def evict(self) -> None:
        """Close this connection to make room for another (serve/admission.py chose it)."""
        if self in self.conns.bodies:
            self._cut_body("evicted_body", "body below the minimum rate, closed to make room",
                           f"{self._pace_words(time.monotonic())}, while all {self.conns.limits.max_connections} "
                           "connections (--max-connections) were in use: closed to make room for another")
            self.conns.drop(self)  # also when it was closing already: its slot is the new connection's
            return
        self.conns.drop(self)
        self.transport.close()
        self.conns.record("evicted")

    def _cut_body(self, reason: str, why: str, message: str) -> None:
        """Close a connection whose request body is not complete: 408 unless an answer has begun."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            self._close(None, reason, "")
            return
        cycle.scope[TIMED_OUT] = why  # type: ignore[typeddict-unknown-key]  # read by MetricsMiddleware
        self._close(None if cycle.response_started else 408, reason, message)

    async def _tracked(self, scope, receive, send) -> None:
        """The app, with the task that runs this connection's request known (connection_lost)."""
        self._task = asyncio.current_task()
        await self._app(scope, receive, send)

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
        conns = self.conns
        conns.busy(self)
        self._cancel_deadline()
        now = time.monotonic()
        self._body_end = now + conns.limits.body_timeout
        if self.expect_100_continue:
            self.flow.hold()  # its body comes after our `100 Continue`, sent at the app's first receive()
        # uvicorn's own check (limit_concurrency) counts connections already closed but not yet gone,
        # which a stream of evictions keeps above the cap, and every running request, the probes' and
        # those of a flood's bodies included, so that a keep-alive client's next request was refused on
        # a connection holding its slot: here a request needs its connection's slot (admission.py).
        # A probe never counts against it: it needs no body, no model, no thread.
        if self.url.split(b"?", 1)[0] in PROBE_PATHS or conns.claim(self):
            if conns.limits.min_body_rate:
                self.pace = BodyPace(self.flow, now)
                conns.bodies[self] = None
            self._arm_body_check(now)
            return super().on_headers_complete()
        self._arm_body_check(now)
        self.conns.record("over_capacity")
        app, self.app = self.app, service_unavailable  # uvicorn's 503 with connection: close
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        if self.pace is not None:
            self.pace.received += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        self.pace = None
        self.conns.bodies.pop(self, None)
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
    conns = Connections(limits, record)
    cls = type("GuardedProtocol", (GuardedProtocol,), {"conns": conns})
    return cls, lambda: len(conns.open)

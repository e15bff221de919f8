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
- a send deadline (--send-timeout): uvicorn awaits a client that does not read its answers for ever
  (its send() waits for the write buffer to drain); a connection whose writing stays paused that long
  is aborted (close() would wait for the flush);
- a bound on pipelining: uvicorn parses every pipelined request it has read and queues them all
  (~7,900 per 256 KiB read of minimal GETs, 80x the bytes in memory), bodies included, which the
  app's budget never sees; here at most MAX_PIPELINE wait, none of them receives its body before it
  runs, and the bytes read beyond them wait unparsed, reading paused, until the queue drains;
- a connection answered before its body was complete waits for its next request's headers like any
  other once that body is in (it was in no group of admission and had no deadline: held for ever);
- an `Upgrade:` request (no protocol but HTTP/1.1 is served) is answered and its connection closed,
  and the lines logged for it and for invalid requests are at most LOG_LINES_PER_S a second of a kind;
- admission (serve/admission.py): at --max-connections a new connection closes one that holds its
  slot without using it (a slowloris, a body behind the minimum rate, a client not reading its
  answers, a connection silent since it opened, an idle keep-alive one); when none can be closed, up
  to RESERVE more are let in so that health probes and /metrics are still answered, and a request on
  one of them gets a slot when its headers are in (closing one then if it can) or a 503 at once.

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
from torchcls.serve.metrics import LogBudget
from torchcls.serve.pace import GRACE_S, BodyPace, TimedFlow

PROBE_PATHS = frozenset({b"/v2/health/live", b"/v2/health/ready", b"/metrics"})
MAX_HEADER_LINES = 100  # Apache's LimitRequestFields: each line costs a tuple of two bytes objects
MIN_CHECK_S = 0.1  # a body's pace is checked at most this often (as its slack nears 0 before a 408)
MAX_PIPELINE = 16  # requests queued behind the one running on a connection (nginx keeps at most 1 read)
# Request lines and headers reach the parser in slices of this many bytes: one slice of minimal pipelined
# requests (18 bytes each) queues at most ~28 beyond MAX_PIPELINE before the bound is looked at again.
HEADER_SLICE = 512


def raw_response(status: int, message: str) -> bytes:
    body = orjson.dumps({"error": message})
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\ncontent-length: ",
                     str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body])


class GuardedProtocol(HttpToolsProtocol):
    conns: Connections  # set on the subclass that protocol_class() makes, one per server
    log_budget: LogBudget  # likewise: lines about bad requests, at most LOG_LINES_PER_S a second of a kind

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None
        self._unparsed = b""  # read while MAX_PIPELINE requests waited: parsed as they drain
        self._upgraded = False
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
        self._cancel_send_deadline()
        self._unparsed = b""
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
        if self in self.conns.stalled:
            return self._abort("evicted_send")
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
        if self._upgraded:
            return  # bytes of a protocol we do not speak: its connection closes after the answer
        if self._unparsed:  # the parser waits for the pipeline to drain (reading paused): keep the order
            self._unparsed += data
            return
        conns = self.conns
        if self._in_headers and not self._header_bytes and (self in conns.fresh or self in conns.served):
            conns.busy(self)  # its first byte: it has begun (a slowloris, if it stays)
            conns.begun[self] = None
        self._feed(data)

    def _queue_full(self) -> bool:
        """Stop parsing: MAX_PIPELINE requests wait, or the newest waiting one is at its body (it gets its
        bytes when it runs, from the app's receive(), counted by --max-inflight-mb)."""
        return len(self.pipeline) >= MAX_PIPELINE or (bool(self.pipeline) and not self._in_headers)

    def _feed(self, data: bytes) -> None:
        cap, offset = self.conns.limits.max_header_bytes, 0
        while offset < len(data):
            if self.transport.is_closing():
                return
            if self._queue_full():
                self._unparsed = data[offset:]
                self.flow.pause_reading()
                self.flow.blocked = True
                return
            size = HEADER_SLICE if self._in_headers else cap
            if self._in_headers:
                if self._header_bytes >= cap:
                    return self._too_large(f"above the server's limit of {cap:,} bytes (--max-header-kb)")
                self._header_bytes += min(size, len(data) - offset)
            try:
                self.parser.feed_data(data[offset:offset + size])
            except httptools.HttpParserUpgrade:
                return self._refuse_upgrade()
            except httptools.HttpParserError:
                if self._refusal is not None:
                    return self._close(*self._refusal)
                self._log("invalid", "Invalid HTTP request received.")
                self.conns.drop(self)
                self.conns.record("invalid_request")
                return self.send_400_response("Invalid HTTP request received.")
            offset += size
        if self._in_headers and self._header_bytes >= cap:
            self._too_large(f"above the server's limit of {cap:,} bytes (--max-header-kb)")

    def _feed_unparsed(self) -> None:
        """The pipeline has room again: parse what was read meanwhile, then read on."""
        if not self._unparsed or self._queue_full() or self.transport.is_closing():
            return
        data, self._unparsed = self._unparsed, b""
        self.flow.blocked = False
        self._feed(data)
        if not self._unparsed:
            self.flow.resume_reading()

    def _refuse_upgrade(self) -> None:
        """uvicorn logged two lines for every later read of such a connection (up to ~32,000 for one);
        the request itself was answered as HTTP/1.1, after which the connection closes."""
        self._upgraded = True
        upgrade = next((v for n, v in self.headers if n == b"upgrade"), b"?")[:40]
        self._log("upgrade", "Unsupported upgrade request (Upgrade: %s): answered over HTTP/1.1, connection closed",
                  upgrade.decode("latin-1"))
        self.conns.record("unsupported_upgrade")
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
        else:
            self.cycle.keep_alive = False  # uvicorn closes it after the answer

    def _log(self, kind: str, message: str, *args) -> None:
        if (suffix := self.log_budget.take(kind)) is not None:
            self.logger.warning(message + "%s", *args, suffix)

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
                conns.receiving(self)
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
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self.pipeline and not self.transport.is_closing():
            # Answered before its body was in (a 404 or 503, or a probe sent with a body): on_response_complete
            # found it still in its body; it waits for its next request's headers from now.
            self._await_headers()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing() and self._in_headers:
            self._await_headers()
        self._feed_unparsed()

    # Bytes out: a client that does not read its answers
    def pause_writing(self) -> None:
        super().pause_writing()
        if self in self.conns.open:  # not one already closing (a 408 its client does not read)
            self.conns.stalled[self] = None
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(self.conns.limits.send_timeout, self._send_late)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.conns.stalled.pop(self, None)
        self._cancel_send_deadline()

    def _cancel_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_late(self) -> None:
        self._send_deadline = None
        self._abort("send_timeout")

    def _abort(self, reason: str) -> None:
        """Close now, dropping what the client has not read (also when a close is already waiting for it)."""
        self.conns.drop(self)
        self.conns.record(reason)
        self.transport.abort()


def protocol_class(limits: ConnectionLimits, record: Callable[[str], None] = lambda reason: None
                   ) -> tuple[type[GuardedProtocol], Callable[[], int]]:
    """A protocol class for one server (uvicorn.Config(http=...)), and a function counting its open
    connections. `record(reason)` is called for each connection closed by a bound."""
    conns = Connections(limits, record)
    cls = type("GuardedProtocol", (GuardedProtocol,), {"conns": conns, "log_budget": LogBudget()})
    return cls, lambda: len(conns.open)

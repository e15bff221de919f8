"""Prometheus metrics of one server (own registry, so several apps in one process do not collide)."""

from __future__ import annotations

import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import ClientDisconnect

from torchcls.serve.limits import TIMED_OUT, ClientGone

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CLIENT_GONE = 499  # nginx's "client closed request": the client left before its body was in; no 5xx
# A flood of cut or abandoned requests (a slow-body flood: thousands a second) must not become a flood
# of log lines filling the disk, or a pipe nobody reads: /metrics counts every one of them anyway.
LOG_LINES_PER_S = 10  # of each kind
log = logging.getLogger("torchcls.serve")


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("torchcls_requests", "HTTP requests by endpoint and status code",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("torchcls_request_duration_seconds", "HTTP request latency by endpoint",
                                 ("endpoint",), registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.batch_size = Histogram("torchcls_batch_size", "images per model call of the dynamic batcher",
                                    registry=self.registry, buckets=BATCH_BUCKETS)
        self.inference = Histogram("torchcls_inference_duration_seconds", "model call time per batch",
                                   registry=self.registry)
        self.queue_depth = Gauge("torchcls_queue_depth", "images accepted and waiting for the model",
                                 registry=self.registry)
        self.closed = Counter("torchcls_connections_closed", "requests ended by a bound (serve/deadlines.py) and "
                              "their connections closed, by reason", ("reason",), registry=self.registry)
        self.inflight_bytes = Gauge("torchcls_inflight_body_bytes", "request body bytes held now "
                                    "(--max-inflight-mb bounds them)", registry=self.registry)

    def observe_batch(self, n: int, seconds: float) -> None:
        self.batch_size.observe(n)
        self.inference.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class LogBudget:
    """At most LOG_LINES_PER_S lines a second of each kind; the next line logged says how many were left out."""

    def __init__(self) -> None:
        self.second = -1
        self.used: dict[str, int] = {}  # lines logged in this second, by kind
        self.left_out: dict[str, int] = {}  # lines not logged since the last one of that kind

    def take(self, kind: str) -> str | None:
        """None: leave this line out; else a suffix for it."""
        now = int(time.monotonic())
        if now != self.second:
            self.second = now
            self.used.clear()
        if self.used.get(kind, 0) >= LOG_LINES_PER_S:
            self.left_out[kind] = self.left_out.get(kind, 0) + 1
            return None
        self.used[kind] = self.used.get(kind, 0) + 1
        n = self.left_out.pop(kind, 0)
        return f" ({n:,} more like it not logged)" if n else ""


class MetricsMiddleware:
    """Counts every request by route template and status, and times it (pure ASGI: cheap).

    A client that left before its body was complete (ClientGone from limits.py, or Starlette's
    ClientDisconnect from a multipart upload) is no server fault: one log line (at most LOG_LINES_PER_S a
    second of a kind), status 499 (408 when serve/deadlines.py cut it: --body-timeout,
    --min-body-rate-kb, --send-timeout), and no traceback."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics, self.log_budget = app, metrics, LogBudget()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except (ClientGone, ClientDisconnect) as e:
            cut = scope.get(TIMED_OUT)  # why the server closed it, if it did
            status = 408 if cut else CLIENT_GONE
            if (suffix := self.log_budget.take(cut or "gone")) is not None:
                client = "%s:%s" % tuple(scope["client"]) if scope.get("client") else "client"
                log.info("%s %s from %s: %s %s%s", scope["method"], scope["path"], client,
                         cut or "client went away", str(e) or "before the body was complete", suffix)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", "unmatched")  # the template: no per-name label explosion
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


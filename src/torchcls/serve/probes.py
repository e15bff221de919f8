"""`torchcls serve --probe-port`: the health probes and /metrics on a port and an event loop of their own.

On the API's port the probes share one event loop with every client. Under a connection-level attack
(benchmarks/serve_soak.py: 1,100 slowloris and 1,100 slow-body connections, 48 clients sending 31 MiB
bodies) that loop was busy reading the attackers' bytes: every probe was answered 200, but at a p99 of
11 s (280 ms without the attacks), where a Kubernetes probe gives up after 1 s. Here a second uvicorn
server runs in a thread with its own event loop, so nothing queued on the API's loop is ahead of a
probe; it waits only for the GIL, which the server's switch interval (server.GIL_SWITCH_INTERVAL_S)
hands over within a fraction of a millisecond. Triton keeps its metrics on a port of their own too.

It answers GET /v2/health/live, /v2/health/ready and /metrics with the app's own answers
(app.probe_answers: ready only once the warm-up inference has run) and the app's token rule (/metrics
needs the token when one is set, the probes never), and nothing else. Its connections go through
serve/protocol.py's GuardedProtocol with bounds of their own (PROBE_LIMITS): a short header deadline, a
small header cap, and a connection cap at which a slow, silent or idle connection is closed to make room,
so that a client that finds this port cannot hold it either.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable

import uvicorn

from torchcls.serve.admission import ConnectionLimits
from torchcls.serve.app import PUBLIC_PATHS
from torchcls.serve.limits import AuthMiddleware, send_error
from torchcls.serve.protocol import protocol_class

log = logging.getLogger("torchcls.serve")
# A probe is one short GET sent at once: 2 s for its headers and 8 KiB of them are plenty. Beyond 8
# connections (+ admission.RESERVE, kept for these very paths) the oldest slow or idle one is closed.
PROBE_LIMITS = ConnectionLimits(max_connections=8, max_header_bytes=8 * 1024, header_timeout=2.0, body_timeout=2.0)
SHUTDOWN_S = 2.0  # for the probe server's open connections, after the API has drained
THREAD = "probe-server"


class _NotThisThreadsInfo(logging.Filter):
    """uvicorn's "Started server process" and "Shutting down" lines, logged a second time by the probe server,
    would read as a second server: its warnings still go through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD or record.levelno >= logging.WARNING


class ProbeApp:
    """ASGI: GET on the paths of `answers` (path -> coroutine function returning a Response); 404 or 405 else."""

    def __init__(self, answers: dict[str, Callable]):
        self.answers = answers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # uvicorn runs it with lifespan="off" and ws="none"
            return
        answer = self.answers.get(scope["path"])
        if answer is None:
            return await send_error(send, 404, f"this port (--probe-port) answers only GET {', '.join(self.answers)}")
        if scope["method"] != "GET":
            return await send_error(send, 405, f"{scope['path']} answers GET only", [(b"allow", b"GET")])
        response = await answer()
        await response(scope, receive, send)


class ProbeServer:
    """The probe port's uvicorn server, in a daemon thread running its own event loop."""

    def __init__(self, answers: dict[str, Callable], sock: socket.socket, token: str | None,
                 record: Callable[[str], None]):
        app = ProbeApp(answers)
        if token:
            app = AuthMiddleware(app, token=token, public=PUBLIC_PATHS, compare=secrets.compare_digest)
        protocol, _ = protocol_class(PROBE_LIMITS, record)
        # log_config=None and no log_level: the API server's uvicorn.Config has set up uvicorn's loggers
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, ws="none", http=protocol,
                                limit_concurrency=None, timeout_graceful_shutdown=SHUTDOWN_S)
        self.server, self.sock = uvicorn.Server(config), sock
        self.thread = threading.Thread(target=self._run, name=THREAD, daemon=True)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException:  # noqa: BLE001 - uvicorn's startup failures are SystemExit; the API keeps serving
            log.exception("the probe server stopped; the probes are still answered on --port")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Close its port and connections (after the API server has drained: probes answer until then)."""
        self.server.should_exit = True
        self.thread.join(SHUTDOWN_S + 3)


def start_probe_server(app, sock: socket.socket, token: str | None) -> ProbeServer:
    """Serve `app`'s probe answers (app.state.probes) on `sock`; its closed connections are counted in
    torchcls_connections_closed_total with reasons prefixed `probe_port_`."""
    closed = app.state.metrics.closed
    probes = ProbeServer(app.state.probes, sock, token, lambda reason: closed.labels(f"probe_port_{reason}").inc())
    logging.getLogger("uvicorn.error").addFilter(_NotThisThreadsInfo())
    probes.start()
    host, port = sock.getsockname()[:2]
    log.info("health probes and /metrics also on http://%s:%d (--probe-port: own thread and event loop)", host, port)
    return probes

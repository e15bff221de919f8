"""`torchcls serve --probe-port`: the health probes and /metrics on a port and an event loop of their own.

On the API's port the probes share one event loop with every client. Under a connection-level attack
(benchmarks/serve_soak.py: 1,100 slowloris and 1,100 slow-body connections, 48 clients sending 31 MiB
bodies) that loop is busy reading the attackers' bytes, and a Kubernetes probe gives up after 1 s. Here
a second Hypercorn server runs in a thread with its own event loop, so nothing queued on the API's loop
is ahead of a probe; it waits only for the GIL, which the server's switch interval
(server.GIL_SWITCH_INTERVAL_S) hands over within a fraction of a millisecond. Triton keeps its metrics
on a port of their own too.

It answers GET /v2/health/live, /v2/health/ready and /metrics with the app's own answers
(app.probe_answers: ready only once the warm-up inference has run) and the app's token rule (/metrics
needs the token when one is set, the probes never), and nothing else. Its connections have bounds of
their own (PROBE_HEADER_TIMEOUT_S, PROBE_HEADER_BYTES), so a client that finds this port cannot hold it.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable

from torchcls.serve.app import PUBLIC_PATHS
from torchcls.serve.limits import AuthMiddleware, send_error
from torchcls.serve.run_loop import hypercorn_config, run_until

log = logging.getLogger("torchcls.serve")
# A probe is one short GET sent at once: 2 s for its headers and 8 KiB of them are plenty.
PROBE_HEADER_TIMEOUT_S = 2.0
PROBE_HEADER_BYTES = 8 * 1024
SHUTDOWN_S = 2.0  # for the probe server's open connections, after the API has drained
THREAD = "probe-server"


async def _lifespan(receive, send) -> None:
    """Nothing to start or stop: acknowledge both."""
    while True:
        kind = (await receive())["type"].rsplit(".", 1)[-1]  # startup, shutdown
        await send({"type": f"lifespan.{kind}.complete"})
        if kind == "shutdown":
            return


class ProbeApp:
    """ASGI: GET on the paths of `answers` (path -> coroutine function returning a Response); 404 or 405 else."""

    def __init__(self, answers: dict[str, Callable]):
        self.answers = answers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        answer = self.answers.get(scope["path"])
        if answer is None:
            return await send_error(send, 404, f"this port (--probe-port) answers only GET {', '.join(self.answers)}")
        if scope["method"] != "GET":
            return await send_error(send, 405, f"{scope['path']} answers GET only", [(b"allow", b"GET")])
        response = await answer()
        await response(scope, receive, send)


class ProbeServer:
    """The probe port's Hypercorn server, in a daemon thread running its own event loop."""

    def __init__(self, answers: dict[str, Callable], sock: socket.socket, token: str | None):
        app = ProbeApp(answers)
        if token:
            app = AuthMiddleware(app, token=token, public=PUBLIC_PATHS, compare=secrets.compare_digest)
        self.app, self.stopping = app, threading.Event()
        self.config = hypercorn_config(sock, PROBE_HEADER_TIMEOUT_S, PROBE_HEADER_BYTES / 1024, SHUTDOWN_S)
        self.thread = threading.Thread(target=self._run, name=THREAD, daemon=True)

    def _run(self) -> None:
        try:
            run_until(self.app, self.config, self.stopping)
        except BaseException:  # noqa: BLE001 - the API keeps serving; the probes are still answered on --port
            log.exception("the probe server stopped; the probes are still answered on --port")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Close its port and connections (after the API server has drained: probes answer until then)."""
        self.stopping.set()
        self.thread.join(SHUTDOWN_S + 3)


def start_probe_server(app, sock: socket.socket, token: str | None) -> ProbeServer:
    """Serve `app`'s probe answers (app.state.probes) on `sock`."""
    probes = ProbeServer(app.state.probes, sock, token)
    probes.start()
    host, port = sock.getsockname()[:2]
    log.info("health probes and /metrics also on http://%s:%d (--probe-port: own thread and event loop)", host, port)
    return probes

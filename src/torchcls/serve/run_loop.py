"""Run an ASGI app on Hypercorn's public entry point (`hypercorn.asyncio.serve`) until a stop is asked.

One function for both of serve's servers: the API (main thread, stopped by SIGINT/SIGTERM or a failed
warm-up) and the probe port (its own thread and event loop, stopped after the API has drained). The
loop is uvloop's where it is installed (Hypercorn runs on any asyncio loop), the stdlib's otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading

# Hypercorn's drain waits for every open connection to close, and its graceful timeout did not end it: a client
# that never reads its answer held a SIGTERM past 35 s here (Python 3.11; from 3.12.1 the listening server's
# wait_closed() waits for connections too, hypercorn#308). The drain gets config.graceful_timeout plus this,
# then the server task is cancelled.
DRAIN_MARGIN_S = 5.0
log = logging.getLogger("torchcls.serve")


def _quiet_cancellations(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if not isinstance(context.get("exception"), asyncio.CancelledError):
        loop.default_exception_handler(context)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def hypercorn_config(sock: socket.socket, header_timeout: float, max_header_kb: float, graceful_timeout: float):
    """The server's own bounds, from its public settings: a connection's headers (serve/deadlines.py has the
    rest, in the app)."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    # Hypercorn's keep-alive timer runs from a connection's opening and from each answer until a request's
    # headers are complete: an idle, silent or slowly trickling client is closed after header_timeout.
    config.keep_alive_timeout = header_timeout
    config.h11_max_incomplete_size = int(max_header_kb * 1024)  # an unfinished request line + headers
    config.keep_alive_max_requests = 2**31  # a pooled client keeps its connection (Hypercorn: 1,000, then close)
    config.graceful_timeout = graceful_timeout
    config.backlog = 2048
    config.accesslog, config.errorlog, config.loglevel = None, "-", "WARNING"
    config.include_server_header = False
    return config


def run_until(app, config, stop: threading.Event, stopped_by: list[int] | None = None) -> None:
    """Serve `app` with Hypercorn `config` until `stop` is set, then drain (config.graceful_timeout) and
    return. With `stopped_by` (main thread only), SIGINT and SIGTERM set `stop` and are recorded there."""
    from hypercorn.asyncio import serve

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        threading.Thread(target=lambda: (stop.wait(), loop.call_soon_threadsafe(stopping.set)),
                         name="serve-stop", daemon=True).start()
        if stopped_by is not None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, lambda s=sig: (stopped_by.append(s), stop.set()))
        served = asyncio.ensure_future(serve(app, config, shutdown_trigger=stopping.wait, mode="asgi"))
        asked = asyncio.ensure_future(stopping.wait())
        await asyncio.wait((served, asked), return_when=asyncio.FIRST_COMPLETED)
        if not served.done():  # draining: give it its graceful timeout, then stop waiting for it
            loop.set_exception_handler(_quiet_cancellations)  # connections cut at the end: one traceback each
            try:
                await asyncio.wait_for(served, config.graceful_timeout + DRAIN_MARGIN_S)
            except asyncio.TimeoutError:
                log.warning("connections still open %.0f s after the drain began (clients that do not read "
                            "their answers); closing", config.graceful_timeout + DRAIN_MARGIN_S)
        asked.cancel()
        if served.done() and not served.cancelled():
            served.result()  # a failure of the server itself is raised here

    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=_new_loop) as runner:
            runner.run(main())
    else:  # Python 3.10: no Runner, the default loop
        asyncio.run(main())

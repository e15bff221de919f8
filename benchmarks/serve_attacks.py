"""Connection-level attacks for benchmarks/serve_soak.py: each runs against a real server until told to stop.

    slowloris      connections that send a request line, then one header line every --trickle-s
    slow body      requests whose headers arrive, then a few body bytes every --trickle-s
    slow-body-flood  --flood-bodies connections (default 1,100: more than --max-connections) whose
                   headers arrive with a Content-Length, then their body one byte every --trickle-s
    huge headers   an unterminated header line sent until the server closes (up to --huge-header-mb)
    large bodies   31 MiB JSON bodies, sent whole, by many clients at once
    parse bombs    31 MiB of `[],[],...` as an infer request's data
    disconnects    requests that close their connection halfway through the body
    answered-early body  --early-clients connections that send a probe declaring a 1-byte body, read its
                   answer, then send the byte and wait (uvicorn held such a connection for ever)
    slow reader    --slow-readers connections (a 4 KiB receive window) that pipeline --reader-requests
                   /metrics scrapes in one write and never read a byte (held for ever: no send timeout)
    pipelining     --pipeline-clients connections that each write --pipeline-requests 32-byte GETs at
                   once and read the answers (uvicorn queued every request it had read: ~8,000 per read)

Each attacker reopens its connection when the server closes it and counts what it saw: the
answers by status, connections the server closed ("closed": EOF or reset) and the longest time
one connection was held open. Loops are bounded: every attacker stops when `stop` is set.

`AttackProcess` runs them in a process and an event loop of their own: thousands of attacking
connections in the measuring process's loop delayed its clients' and probes' reads by seconds, which
serve_soak.py then reported as the server's latency.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable

MiB = 2**20
ATTACKS = ("slowloris", "slow body", "slow-body-flood", "huge headers", "large bodies", "parse bombs", "disconnects",
           "answered-early body", "slow reader", "pipelining")
TCP_CLOSE = 7  # tcpi_state (Linux): the server reset the connection, seen without reading from it


def _head(method: str, path: str, length: int | None = None) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{size}".encode()


def _status(head: bytes) -> str:
    parts = head.split(b" ", 2)
    return parts[1].decode() if head.startswith(b"HTTP/1.") and len(parts) > 1 else "closed"


class Attack:
    def __init__(self, kind: str):
        self.kind, self.outcomes, self.connections, self.longest_s = kind, Counter(), 0, 0.0

    def report(self) -> dict:
        return {"connections": self.connections, "outcomes": dict(sorted(self.outcomes.items())),
                "longest_open_s": round(self.longest_s, 2)}


async def _answer(reader: asyncio.StreamReader, timeout: float) -> str:
    """The status of the server's answer, or "closed" when it closed without one."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        return _status(head)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
        return "closed"


async def _connect(port: int, attack: Attack, wait: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A new connection counted for `attack`, or None (counted as a failed connect, after `wait` s)."""
    try:
        conn = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        attack.outcomes["connect failed"] += 1
        await asyncio.sleep(wait)
        return None
    attack.connections += 1
    return conn


async def _trickle(port: int, attack: Attack, stop: asyncio.Event, first: bytes, drip: Callable[[int], bytes],
                   every: float) -> None:
    """Open, send `first`, then `drip(i)` every `every` s until the server answers or closes; repeat."""
    while not stop.is_set():
        t0 = time.monotonic()
        if (conn := await _connect(port, attack, every)) is None:
            continue
        reader, writer = conn
        answer = asyncio.ensure_future(_answer(reader, 3600))
        try:
            writer.write(first)
            i = 0
            while not stop.is_set() and not answer.done():
                await asyncio.wait([answer], timeout=every)
                if not answer.done():
                    writer.write(drip(i))
                    await writer.drain()
                    i += 1
        except OSError:
            pass
        if answer.done():
            attack.outcomes[answer.result()] += 1
        else:
            answer.cancel()
            attack.outcomes["open at the end"] += 1
        attack.longest_s = max(attack.longest_s, time.monotonic() - t0)
        writer.close()


async def _send_whole(port: int, attack: Attack, stop: asyncio.Event, payload: bytes, cut: int | None = None,
                      timeout: float = 120) -> None:
    """Send `payload` (or its first `cut` bytes, then close) and read the answer; repeat until stopped."""
    while not stop.is_set():
        t0 = time.monotonic()
        if (conn := await _connect(port, attack, 0.5)) is None:
            continue
        reader, writer = conn
        answer = asyncio.ensure_future(_answer(reader, timeout))
        end = len(payload) if cut is None else cut
        try:  # 1 MiB at a time: 48 clients must not hold 48 copies of 31 MiB in this process
            for i in range(0, end, MiB):
                if answer.done():
                    break  # answered (refused) before the whole body was sent
                writer.write(payload[i:min(i + MiB, end)])
                await writer.drain()
        except OSError:
            pass
        if cut is not None:
            writer.close()
            answer.cancel()
            attack.outcomes["disconnected"] += 1
            await asyncio.sleep(0.05)
            continue
        attack.outcomes[await answer] += 1
        attack.longest_s = max(attack.longest_s, time.monotonic() - t0)
        writer.close()


async def _answered_early(port: int, attack: Attack, stop: asyncio.Event) -> None:
    """A probe that declares a 1-byte body, its answer read, then the byte: held until the server closes."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            attack.connections += 1
            writer.write(_head("GET", "/v2/health/live", 1) + b"\r\n")
            status = await _answer(reader, 30)
            writer.write(b"x")
            await reader.read(65536)  # the rest of the answer, then EOF when the server closes
            while not stop.is_set() and await reader.read(65536):
                pass
        except OSError:
            attack.outcomes["connect failed"] += 1
            await asyncio.sleep(0.5)
            continue
        attack.outcomes["open at the end" if stop.is_set() else f"{status}, then closed"] += 1
        attack.longest_s = max(attack.longest_s, time.monotonic() - t0)
        writer.close()


def _tcp_state(sock: socket.socket) -> int:
    return struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]


async def _slow_reader(port: int, attack: Attack, stop: asyncio.Event, requests: int) -> None:
    """Pipeline `requests` /metrics scrapes with a 4 KiB receive window, never read; until the server resets it."""
    loop = asyncio.get_running_loop()
    payload = _head("GET", "/metrics") + b"\r\n"
    while not stop.is_set():
        t0 = time.monotonic()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            attack.connections += 1
            await asyncio.wait_for(loop.sock_sendall(sock, payload * requests), 30)
            while not stop.is_set() and _tcp_state(sock) != TCP_CLOSE:
                await asyncio.sleep(0.2)
            attack.outcomes["open at the end" if stop.is_set() else "closed"] += 1
        except (OSError, asyncio.TimeoutError):
            attack.outcomes["closed"] += 1
        attack.longest_s = max(attack.longest_s, time.monotonic() - t0)
        sock.close()


async def _pipelining(port: int, attack: Attack, stop: asyncio.Event, requests: int) -> None:
    """`requests` minimal GETs in one write, their answers read and counted by status; repeat."""
    payload = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * requests  # HTTP/1.1 needs Host (h11: 400)
    while not stop.is_set():
        if (conn := await _connect(port, attack, 0.5)) is None:
            continue
        reader, writer = conn
        t0 = time.monotonic()
        writer.write(payload)
        try:
            for _ in range(requests):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = re.search(rb"content-length: (\d+)", head, re.I)
                await reader.readexactly(int(length.group(1)) if length else 0)
                attack.outcomes[_status(head)] += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
            attack.outcomes["closed"] += 1
        attack.longest_s = max(attack.longest_s, time.monotonic() - t0)
        writer.close()


def plan(kinds: list[str], port: int, name: str, shape: list[int], args, stop: asyncio.Event
         ) -> tuple[dict[str, Attack], list]:
    """(kind -> its counters, the coroutines to run until `stop` is set) for the chosen attack kinds."""
    infer = f"/v2/models/{name}/infer"
    size = 31 * MiB
    envelope = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": %s, "data": [' % str(shape).encode()
    zeros = envelope + b"0," * ((size - len(envelope)) // 2 - 8) + b"0]}]}"
    bomb = envelope + b"[]," * ((size - len(envelope)) // 3 - 8) + b"[]]}]}"
    attacks = {k: Attack(k) for k in kinds}
    jobs = []
    for kind, attack in attacks.items():
        if kind == "slowloris":
            jobs += [_trickle(port, attack, stop, _head("GET", "/v2/health/live"), lambda i: b"X-Slow-%d: 1\r\n" % i,
                              args.trickle_s) for _ in range(args.slow_connections)]
        elif kind == "slow body":
            jobs += [_trickle(port, attack, stop, _head("POST", infer, MiB) + b"\r\n" + envelope,
                              lambda i: b"0,", args.trickle_s) for _ in range(args.slow_bodies)]
        elif kind == "slow-body-flood":
            jobs += [_trickle(port, attack, stop, _head("POST", infer, MiB) + b"\r\n", lambda i: b"0", args.trickle_s)
                     for _ in range(args.flood_bodies)]
        elif kind == "huge headers":
            chunk = b"a" * 65536
            limit = int(args.huge_header_mb * MiB) // len(chunk)
            jobs += [_trickle(port, attack, stop, _head("GET", "/v2/health/live") + b"X-Huge: ",
                              lambda i: chunk if i < limit else b"", 0.001) for _ in range(args.huge_header_clients)]
        elif kind == "large bodies":
            jobs += [_send_whole(port, attack, stop, _head("POST", infer, len(zeros)) + b"\r\n" + zeros)
                     for _ in range(args.large_body_clients)]
        elif kind == "parse bombs":
            jobs += [_send_whole(port, attack, stop, _head("POST", infer, len(bomb)) + b"\r\n" + bomb)
                     for _ in range(args.bomb_clients)]
        elif kind == "answered-early body":
            jobs += [_answered_early(port, attack, stop) for _ in range(args.early_clients)]
        elif kind == "slow reader":
            jobs += [_slow_reader(port, attack, stop, args.reader_requests) for _ in range(args.slow_readers)]
        elif kind == "pipelining":
            jobs += [_pipelining(port, attack, stop, args.pipeline_requests) for _ in range(args.pipeline_clients)]
        elif kind == "disconnects":
            body = _head("POST", infer, len(zeros)) + b"\r\n" + zeros
            jobs += [_send_whole(port, attack, stop, body, cut=len(body) // 2) for _ in range(args.disconnect_clients)]
    return attacks, jobs


def _attack_main(kinds: list[str], port: int, name: str, shape: list[int], args, stop_flag, started, results) -> None:
    async def main() -> dict:
        stop = asyncio.Event()
        attacks, jobs = plan(kinds, port, name, shape, args, stop)
        tasks = [asyncio.create_task(job) for job in jobs]
        started.set()
        while not stop_flag.is_set():
            await asyncio.sleep(0.2)
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=30) if tasks else (None, [])
        for task in pending:
            task.cancel()
        return {kind: attack.report() for kind, attack in attacks.items()}

    results.put(asyncio.run(main()))


class AttackProcess:
    """The chosen attacks, running in a child process from construction until `finish()` (their reports)."""

    def __init__(self, kinds: list[str], port: int, name: str, shape: list[int], args) -> None:
        ctx = multiprocessing.get_context("spawn")  # the parent has torch loaded: no fork
        self.stop_flag, self.started, self.results = ctx.Event(), ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_attack_main, daemon=True,
                                args=(kinds, port, name, shape, args, self.stop_flag, self.started, self.results))
        self.proc.start()

    def wait_started(self, timeout: float = 120.0) -> None:
        if not self.started.wait(timeout):
            raise SystemExit(f"the attack process did not start within {timeout:g} s (exit code {self.proc.exitcode})")

    def finish(self) -> dict:
        self.stop_flag.set()
        reports = self.results.get(timeout=120)
        self.proc.join(30)
        return reports

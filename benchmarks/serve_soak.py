"""Soak test of `torchcls serve` under hostile load on loopback: every request answered, no 5xx.

    python benchmarks/serve_soak.py                          # 10,000 requests, 32 clients, ResNet-18 at 64 px
    python benchmarks/serve_soak.py runs/demo --requests 2000 --concurrency 16

A real server process gets --requests requests from --concurrency keep-alive clients (a minimal
asyncio HTTP/1.1 client). A fifth of them are hostile: a 2,000,000x4 PNG, a 16-bit 8000x8000
PNG (decodes at 64 MP: one per --heavy-every hostile requests), an EPS file, an .ico whose 16x16 entry
embeds a 30000x30000 PNG, garbage bytes, a
truncated JPEG, an empty body, bad JSON, duplicate and unknown outputs, an oversize batch, a
wrong shape, a binary header that lies, a body above the size limit, an unknown model. The rest
are good OIP infer requests (JSON and binary) and /predict uploads.

Meanwhile connection-level attacks run (--attacks, benchmarks/serve_attacks.py): slowloris headers,
slow bodies, a slow-body flood (more connections than --max-connections, each trickling a body a
byte at a time), huge headers, many 31 MiB bodies at once, 31 MiB parse bombs and mid-body
disconnects, each reopening its connections for as long as the soak runs. They are reported apart
(what each attacker saw) with the server's own counts from /metrics (499, 408, connections closed
by reason); the headline figures (5xx, lost, probe p99, RSS) are those of the server under attack.

Reported: answers by status, 5xx other than 503 (must be 0), accepted requests lost (sent and never
answered: must be 0), 503 count, wrong statuses (a good request refused or a hostile one accepted:
must be 0), p50/p99 latency, health-probe latency during the soak, and the server's RSS (with its
model process) before, at peak and after. Bounded: no new request after --timeout seconds, and
every request waits at most --request-timeout for its answer. Prints JSON, then a Markdown table;
exits 1 if any 5xx, lost request, wrong status or failed health probe.

The measurement for the README, with nothing else running (the issue's sizes: 1,100 slowloris
connections and 1,100 trickled bodies against the default --max-connections 1024, 48 large bodies,
4 x 256 MiB headers):

    python benchmarks/serve_soak.py --requests 10000 --concurrency 32 --json-out soak.json

With --probe-port PORT (0 = a free one) the server gets `--probe-port` and the health probes are measured
there, the headline probe figures are that port's, and the API's port is probed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import re
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from serve_attacks import ATTACKS, AttackProcess  # noqa: E402
from serve_load import free_port, make_checkpoint  # noqa: E402

# A hostile request is refused by any 4xx the server means: 408 too, when its body did not arrive within
# --body-timeout (seen for a declared-too-large body at the test's 2 s, the loop behind on a slow CPU)
OK, REFUSED = {200, 503}, {400, 404, 408, 413, 503}
REFUSALS = (("concurrency", "--max-connections"), ("max-inflight", "--max-inflight-mb"),
            ("queue is full", "--max-queue"), ("warming up", "warming up"))


def http(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    head = {"Host": "127.0.0.1", "Content-Length": str(len(body)), **(headers or {})}
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
            + "\r\n").encode() + body


def png(im: Image.Image) -> bytes:
    out = io.BytesIO()
    im.save(out, format="PNG", compress_level=9)
    return out.getvalue()


def encoded(im: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    im.save(out, format=fmt)
    return out.getvalue()


def ico_bomb(side: int = 30000, zeros_mb: int = 64) -> bytes:
    """An .ico whose directory says 16x16 and whose one entry embeds a `side`x`side` RGBA PNG (Pillow decodes
    that PNG inside Image.open): ~`zeros_mb` KB on the wire. Each MiB of zeros after a full flush compresses
    to the same block, so the file is built without compressing gigabytes."""
    c = zlib.compressobj(9)
    block = c.compress(bytes(2**20)) + c.flush(zlib.Z_FULL_FLUSH)
    idat = block + (c.compress(bytes(2**20)) + c.flush(zlib.Z_FULL_FLUSH)) * (zeros_mb - 1)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 6, 0, 0, 0))
           + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(png), 22) + png


def infer_json(shape: list[int], data: list[float] | None = None, **extra) -> bytes:
    values = data if data is not None else np.random.default_rng(0).standard_normal(int(np.prod(shape))).tolist()
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": shape, "data": values}],
                       **extra}).encode()


def request_kinds(name: str, channels: int, size: int, max_batch: int, heavy: bool) -> tuple[dict, dict, dict]:
    """(good, hostile, heavy): kind -> (request bytes, the statuses that are right for it)."""
    infer, predict = f"/v2/models/{name}/infer", "/predict"
    js = {"Content-Type": "application/json"}
    shape = [1, channels, size, size]
    photo = Image.fromarray(np.random.default_rng(1).integers(0, 255, (size, size, 3), dtype=np.uint8))
    x = np.random.default_rng(2).standard_normal(shape).astype("<f4")
    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": shape,
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    jpeg = encoded(photo, "JPEG")
    good = {
        "infer json": (http("POST", infer, infer_json(shape, outputs=[{"name": "probabilities"},
                                                                     {"name": "labels"}]), js), OK),
        "infer binary": (http("POST", infer, header + x.tobytes(),
                              {"Inference-Header-Content-Length": str(len(header))}), OK),
        "predict png": (http("POST", predict + "?topk=3", png(photo)), OK),
    }
    small = [0.0] * int(np.prod(shape))
    hostile = {
        "wide png 2000000x4": (http("POST", predict, png(Image.new("L", (2_000_000, 4)))), REFUSED),
        "eps file": (http("POST", predict, encoded(photo, "EPS")), REFUSED),
        "ico bomb 30000x30000": (http("POST", predict, ico_bomb()), REFUSED),
        "garbage bytes": (http("POST", predict, bytes(range(256)) * 8), REFUSED),
        "truncated jpeg": (http("POST", predict, jpeg[:len(jpeg) // 2]), REFUSED),
        "empty body": (http("POST", predict), REFUSED),
        "bad json": (http("POST", infer, b'{"inputs": [{"name": "input", "data": [1, 2,', js), REFUSED),
        "garbage infer": (http("POST", infer, bytes(range(256)) * 8, js), REFUSED),
        "duplicate outputs": (http("POST", infer, infer_json(shape, small, outputs=[{"name": "logits"}] * 50),
                                   js), REFUSED),
        "unknown output": (http("POST", infer, infer_json(shape, small, outputs=[{"name": "embeddings"}]), js),
                           REFUSED),
        "oversize batch": (http("POST", infer, infer_json([max_batch + 1, channels, size, size], [0.0]), js),
                           REFUSED),
        "wrong shape": (http("POST", infer, infer_json([1, channels, size + 1, size], [0.0]), js), REFUSED),
        "lying binary header": (http("POST", infer, header + x.tobytes()[:100],
                                     {"Inference-Header-Content-Length": str(len(header))}), REFUSED),
        "body above limit": (http("POST", infer, b"", {**js, "Content-Length": str(2**30)}), REFUSED),
        "unknown model": (http("POST", "/v2/models/nope/infer", infer_json(shape, small), js), REFUSED),
    }
    if not heavy:
        return good, hostile, {}
    big = np.zeros((8000, 8000), np.uint16)  # ~125 KB as a PNG; 64 MP, 16 bits per pixel decoded
    big[::97] = 60000
    return good, hostile, {"16-bit png 8000x8000": (http("POST", predict, png(Image.fromarray(big))), OK)}


def schedule(n: int, good: dict, hostile: dict, heavy: dict, heavy_every: int) -> list[str]:
    """Kinds of the n requests in order: every fifth hostile (one in `heavy_every` of those heavy)."""
    goods, bads, heavies = itertools.cycle(good), itertools.cycle(hostile), itertools.cycle(heavy)
    kinds, n_hostile = [], 0
    for i in range(n):
        if i % 5 != 4:
            kinds.append(next(goods))
            continue
        kinds.append(next(heavies) if heavy and n_hostile % heavy_every == 0 else next(bads))
        n_hostile += 1
    return kinds


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()  # no length: the body ends with the connection
        headers["connection"] = "close"
    if status == 503:  # which bound refused it
        text = body.decode("latin-1")
        headers["refused-by"] = next((why for key, why in REFUSALS if key in text), text[:60])
    return status, headers


async def exchange(conn, payload: bytes, request_timeout: float) -> tuple[int, dict[str, str]]:
    conn[1].write(payload)
    return await asyncio.wait_for(read_response(conn[0]), request_timeout)


async def client(port: int, queue: list, requests: dict, state: dict, request_timeout: float) -> None:
    conn = None
    while queue and time.monotonic() < state["deadline"]:
        kind = queue.pop()
        payload, _ = requests[kind]
        state["sent"][kind] += 1
        t0 = time.perf_counter()
        try:
            reused = conn is not None
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port)
            try:
                status, headers = await exchange(conn, payload, request_timeout)
            except (asyncio.IncompleteReadError, ConnectionResetError) as e:
                # A pooled keep-alive connection the server closed while idle (its keep-alive timeout, or
                # room made under a connection flood), no byte of an answer read: HTTP clients retry such a
                # request once on a new connection (urllib3, httpcore). Counted, never hidden.
                if not reused or (isinstance(e, asyncio.IncompleteReadError) and e.partial):
                    raise
                state["retried_idle_closed"] += 1
                conn[1].close()
                conn = await asyncio.open_connection("127.0.0.1", port)
                status, headers = await exchange(conn, payload, request_timeout)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            state["lost"][kind] += 1
            state["lost_reasons"][type(e).__name__] += 1
            if conn is not None:
                conn[1].close()
            conn = None
            continue
        state["answers"].append((kind, status, time.perf_counter() - t0))
        if status == 503:
            state["refused_by"][headers["refused-by"]] += 1
        if headers.get("connection", "").lower() == "close":
            conn[1].close()
            conn = None
    if conn is not None:
        conn[1].close()


def peak_rss_mb(pid: int) -> float:
    """The server process's own peak RSS since it started (VmHWM): no peak falls between two samples."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def tree_rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


async def monitor(port: int, pid: int, state: dict, done: asyncio.Event, key: str = "probes") -> None:
    """RSS peak and health-probe latency (in state[key]), sampled while the soak runs."""
    while not done.is_set():
        state["rss_peak_mb"] = max(state["rss_peak_mb"], tree_rss_mb(pid))
        t0 = time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(http("GET", "/v2/health/live", headers={"Connection": "close"}))
            status, _ = await asyncio.wait_for(read_response(reader), 30)
            writer.close()
            state[key].append((status, time.perf_counter() - t0))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            state[key].append((0, time.perf_counter() - t0))
        try:
            await asyncio.wait_for(done.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def soak(port: int, pid: int, kinds: list[str], requests: dict, concurrency: int, timeout: float,
               request_timeout: float, attack=None, probe_port: int | None = None) -> dict:
    """`attack()` -> an AttackProcess (serve_attacks.py): attackers that run until the soak's clients are done.
    The health probes go to `probe_port` (the server's --probe-port) when given, else to the API's port."""
    state = {"deadline": time.monotonic() + timeout, "sent": Counter(), "lost": Counter(),
             "lost_reasons": Counter(), "answers": [], "probes": [], "rss_peak_mb": 0.0, "retried_idle_closed": 0,
             "refused_by": Counter(), "api_port_probes": []}
    queue = list(reversed(kinds))  # pop() from the end takes them in schedule order
    done = asyncio.Event()
    watcher = asyncio.create_task(monitor(probe_port or port, pid, state, done))
    # With a probe port, the API's port is probed as well, side by side: what --probe-port changes
    api_watcher = asyncio.create_task(monitor(port, pid, state, done, "api_port_probes")) if probe_port else None
    attackers = attack() if attack else None
    if attackers:
        await asyncio.get_running_loop().run_in_executor(None, attackers.wait_started)
        await asyncio.sleep(2.0)  # let the attack build up before the measured traffic starts
    t0 = time.perf_counter()
    await asyncio.gather(*(client(port, queue, requests, state, request_timeout) for _ in range(concurrency)))
    state["seconds"] = time.perf_counter() - t0
    done.set()
    await watcher
    if api_watcher is not None:
        await api_watcher
    state["attacks"] = await asyncio.get_running_loop().run_in_executor(None, attackers.finish) if attackers else {}
    state["unsent"] = len(queue)
    return state


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else float("nan")


def summarise(state: dict, requests: dict, good: dict) -> dict:
    by_kind: dict[str, dict] = {}
    statuses, latencies = defaultdict(Counter), defaultdict(list)
    for kind, status, seconds in state["answers"]:
        statuses[kind][status] += 1
        latencies[kind].append(seconds)
    wrong = 0
    for kind, (_, allowed) in requests.items():
        bad = sum(n for s, n in statuses[kind].items() if s not in allowed and not 500 <= s < 600)
        wrong += bad
        by_kind[kind] = {"hostile": kind not in good, "sent": state["sent"][kind], "lost": state["lost"][kind],
                         "statuses": {str(s): n for s, n in sorted(statuses[kind].items())}, "wrong_status": bad,
                         "p50_ms": pct(latencies[kind], 0.5), "p99_ms": pct(latencies[kind], 0.99)}
    every = Counter(s for _, s, _ in state["answers"])
    all_lat = [sec for _, _, sec in state["answers"]]
    good_lat = [sec for kind, s, sec in state["answers"] if kind in good and s == 200]
    probes = [sec for _, sec in state["probes"]]
    return {
        "sent": sum(state["sent"].values()), "answered": len(state["answers"]), "unsent": state["unsent"],
        "lost": sum(state["lost"].values()), "lost_reasons": dict(state["lost_reasons"]),
        "server_errors_5xx": sum(n for s, n in every.items() if 500 <= s < 600 and s != 503),
        "rejected_503": every[503], "rejected_503_by": dict(state["refused_by"]), "wrong_status": wrong,
        "hostile_sent": sum(v["sent"] for v in by_kind.values() if v["hostile"]),
        "seconds": state["seconds"], "requests_per_s": len(state["answers"]) / state["seconds"],
        "p50_ms": pct(all_lat, 0.5), "p99_ms": pct(all_lat, 0.99),
        "good_p50_ms": pct(good_lat, 0.5), "good_p99_ms": pct(good_lat, 0.99),
        "probe_p99_ms": pct(probes, 0.99), "probe_max_ms": max(probes, default=float("nan")) * 1e3,
        "probes_failed": sum(1 for s, _ in state["probes"] if s != 200), "probes": len(state["probes"]),
        "probe_failures": dict(Counter(str(s) for s, _ in state["probes"] if s != 200)),
        "api_port_probe_p99_ms": pct([sec for _, sec in state["api_port_probes"]], 0.99),
        "api_port_probes_failed": sum(1 for s, _ in state["api_port_probes"] if s != 200),
        "api_port_probes": len(state["api_port_probes"]),
        "retried_idle_closed": state["retried_idle_closed"], "attacks": state.get("attacks", {}),
        "rss_peak_mb": state["rss_peak_mb"], "by_kind": by_kind,
    }


def start_server(artifact: str, port: int, args: argparse.Namespace, log: Path,
                 probe_port: int | None = None) -> subprocess.Popen:
    """The server, its log in `log`: a pipe that nobody reads while the soak runs would fill, and the
    server would block on its next log line."""
    cmd = [sys.executable, "-m", "torchcls", "serve", artifact, "--port", str(port), "--max-batch",
           str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms), "--max-body-mb", str(args.max_body_mb),
           "--threads", str(args.threads), *shlex.split(args.serve_args)]
    cmd += ["--probe-port", str(probe_port)] if probe_port else []
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"the server did not become ready: {log.read_text()[-2000:]}")


def markdown(r: dict) -> str:
    rows = ["| request | hostile | sent | lost | statuses | wrong | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for kind, v in r["by_kind"].items():
        codes = ", ".join(f"{s}: {n}" for s, n in v["statuses"].items())
        rows.append(f"| {kind} | {'yes' if v['hostile'] else ''} | {v['sent']} | {v['lost']} | {codes} | "
                    f"{v['wrong_status']} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} |")
    from torchcls.machine import machine_line

    return (f"Machine: {machine_line(r['machine'])}, server threads {r['machine']['server_threads']}\n\n"
            f"{r['model']} ({r['input_shape']}), {r['sent']} requests ({r['hostile_sent']} hostile) from "
            f"{r['concurrency']} clients in {r['seconds']:.0f} s; health probes on {r['probes_on']}\n\n"
            f"| 5xx (not 503) | lost | 503 | wrong status | p50 ms | p99 ms | probe p99 ms | RSS before MB | "
            f"RSS peak MB | RSS after MB |\n|---|---|---|---|---|---|---|---|---|---|\n"
            f"| {r['server_errors_5xx']} | {r['lost']} | {r['rejected_503']} | {r['wrong_status']} | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['probe_p99_ms']:.1f} | {r['rss_before_mb']:.0f} | "
            f"{r['rss_peak_mb']:.0f} | {r['rss_after_mb']:.0f} |\n\n" + api_port_probes(r) + "\n".join(rows)
            + attack_table(r))


def api_port_probes(r: dict) -> str:
    if not r.get("probe_port"):
        return ""
    return (f"Meanwhile on the API's port: health probe p99 {r['api_port_probe_p99_ms']:.1f} ms, "
            f"{r['api_port_probes_failed']} failed\n\n")


def attack_table(r: dict) -> str:
    if not r["attacks"]:
        return ""
    rows = ["| attack | connections | what the attacker saw | longest open s |", "|---|---|---|---|"]
    for kind, a in r["attacks"].items():
        seen = ", ".join(f"{k}: {n}" for k, n in a["outcomes"].items())
        rows.append(f"| {kind} | {a['connections']} | {seen} | {a['longest_open_s']:.1f} |")
    server = ", ".join(f"{k}: {v:g}" for k, v in r.get("server_counts", {}).items())
    return "\n\n" + "\n".join(rows) + f"\n\nThe server's counts (/metrics): {server}"


def server_counts(port: int) -> dict[str, float]:
    """What the server itself counted: answers by status beyond 2xx/4xx of the soak, connections closed by a bound."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, float] = Counter()
    for labels, value in re.findall(r"^torchcls_requests_total\{(.*)\} (\S+)$", text, re.M):
        status = re.search(r'status="(\d+)"', labels).group(1)
        counts[f"status {status}"] += float(value)
    for reason, value in re.findall(r'^torchcls_connections_closed_total\{reason="(\w+)"\} (\S+)$', text, re.M):
        counts[f"closed {reason}"] += float(value)
    return dict(sorted(counts.items()))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", nargs="?", help="artifact to serve (default: an untrained --model checkpoint)")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--timeout", type=float, default=900.0, help="no new request after this many seconds")
    p.add_argument("--request-timeout", type=float, default=120.0, help="longest wait for one answer")
    p.add_argument("--heavy-every", type=int, default=200,
                   help="one 16-bit 8000x8000 PNG per this many hostile requests (0 = none)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--max-body-mb", type=float, default=32.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server's model")
    p.add_argument("--json-out", help="also write the JSON result here")
    p.add_argument("--probe-port", type=int, help="start the server with `--probe-port PORT` (0 = a free one) and "
                   "send the health probes there (default: on the API's port, as without it)")
    p.add_argument("--serve-args", default="", help="more flags for `torchcls serve` (e.g. '--header-timeout 2')")
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help=f"attack kinds run during the soak, comma-separated, or 'none' (default: all of {ATTACKS})")
    p.add_argument("--slow-connections", type=int, default=1100, help="slowloris connections (header trickle)")
    p.add_argument("--slow-bodies", type=int, default=64, help="connections trickling a body after its headers")
    p.add_argument("--flood-bodies", type=int, default=1100,
                   help="connections of the slow-body flood (each trickles its body one byte every --trickle-s)")
    p.add_argument("--trickle-s", type=float, default=5.0, help="seconds between a slow client's sends")
    p.add_argument("--huge-header-clients", type=int, default=4)
    p.add_argument("--huge-header-mb", type=float, default=256.0, help="bytes of one unterminated header, at most")
    p.add_argument("--large-body-clients", type=int, default=48, help="clients sending 31 MiB bodies at once")
    p.add_argument("--bomb-clients", type=int, default=2, help="clients sending 31 MiB of [],[],... as data")
    p.add_argument("--disconnect-clients", type=int, default=8, help="clients leaving halfway through a 31 MiB body")
    p.add_argument("--early-clients", type=int, default=64,
                   help="connections answered before their 1-byte body, which they send after the answer")
    p.add_argument("--slow-readers", type=int, default=64, help="connections that pipeline scrapes and never read")
    p.add_argument("--reader-requests", type=int, default=300, help="/metrics scrapes each slow reader pipelines")
    p.add_argument("--pipeline-clients", type=int, default=2, help="connections pipelining --pipeline-requests GETs")
    p.add_argument("--pipeline-requests", type=int, default=20_000, help="32-byte GETs written at once, then read")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from torchcls.artifacts.artifact import load_artifact
    from torchcls.machine import describe_machine

    with tempfile.TemporaryDirectory(prefix="serve-soak-") as tmp:
        path = args.artifact or str(make_checkpoint(args.model, args.img_size, args.classes, Path(tmp)))
        info = load_artifact(path).info
        pre = info.preprocess
        good, hostile, heavy = request_kinds(info.name, pre.channels, pre.img_size, args.max_batch,
                                             args.heavy_every > 0)
        requests = {**good, **hostile, **heavy}
        kinds = schedule(args.requests, good, hostile, heavy, args.heavy_every)
        port = free_port()
        probe_port = None if args.probe_port is None else args.probe_port or free_port()
        server = start_server(path, port, args, Path(tmp) / "server.log", probe_port)
        try:
            asyncio.run(soak(port, server.pid, [next(iter(good))] * args.concurrency, requests, args.concurrency,
                             60, args.request_timeout))  # warm the connections and the batcher
            rss_before = tree_rss_mb(server.pid)
            chosen = [] if args.attacks == "none" else [k.strip() for k in args.attacks.split(",") if k.strip()]
            unknown = sorted(set(chosen) - set(ATTACKS))
            if unknown:
                raise SystemExit(f"--attacks: unknown {unknown}; choose from {list(ATTACKS)} or 'none'")
            shape = [1, pre.channels, pre.img_size, pre.img_size]
            state = asyncio.run(soak(port, server.pid, kinds, requests, args.concurrency, args.timeout,
                                     args.request_timeout,
                                     lambda: AttackProcess(chosen, port, info.name, shape, args) if chosen else None,
                                     probe_port))
            time.sleep(1.0)
            rss_after = tree_rss_mb(server.pid)
            counts = server_counts(port) | {"peak RSS since start (VmHWM) MB": round(peak_rss_mb(server.pid))}
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                exit_code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                exit_code = server.wait()
    result = {"model": info.name if args.artifact else args.model, "target": info.target,
              "input_shape": [1, pre.channels, pre.img_size, pre.img_size], "concurrency": args.concurrency,
              "requests": args.requests, "max_batch": args.max_batch, "cpu_count": psutil.cpu_count(),
              **summarise(state, requests, good), "rss_before_mb": rss_before, "rss_after_mb": rss_after,
              "server_exit_code": exit_code, "probe_port": probe_port,
              "probes_on": f"the probe port (--probe-port {probe_port})" if probe_port else "the API's port",
              "machine": describe_machine(info.precision) | {"server_threads": args.threads}}
    result["server_counts"] = counts
    print(json.dumps(result, indent=2))
    print()
    print(markdown(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    failed = (result["server_errors_5xx"] or result["lost"] or result["wrong_status"] or result["probes_failed"]
              or exit_code != 0)
    print(f"\n{'FAIL' if failed else 'PASS'}: {result['server_errors_5xx']} 5xx (not 503), {result['lost']} lost, "
          f"{result['wrong_status']} wrong statuses, {result['rejected_503']} 503, {result['probes_failed']} failed "
          f"probes, server exit {exit_code}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

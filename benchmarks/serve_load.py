"""Load test of `torchcls serve` on loopback: server throughput vs the raw artifact, and latency by concurrency.

    python benchmarks/serve_load.py runs/demo                     # a run dir, .safetensors, .pt2 or .onnx
    python benchmarks/serve_load.py --model resnet18 --img-size 64  # an untrained checkpoint made here

The raw baseline calls the artifact in this process with the server's max batch. Each
concurrency level keeps C clients sending one-image OIP infer requests over keep-alive
connections (a minimal asyncio HTTP/1.1 client, so the load generator costs little CPU);
every level stops after --requests requests or --seconds seconds, whichever is first.
Raw and load runs are interleaved for --rounds rounds; medians are reported. Prints JSON,
then a Markdown table. Load generator and server share this machine's cores.

--compare-model-process also starts a server with --model-process (the model in a process of
its own, serve/worker.py, instead of a thread of the HTTP process) and runs the same levels
against it, interleaved with the default server's, under the JSON key `model_process`.

--peers litserve also serves the same artifact with another serving stack (benchmarks/litserve_peer.py:
LitServe, loading the model with torchcls' load_artifact, so model and precision are identical) and
runs the same levels against it, interleaved, under `peers: {"litserve": {...}}` and as rows of the
table. Peers need the `bench` extra (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch


def make_checkpoint(model: str, img_size: int, classes: int, folder: Path) -> Path:
    """An untrained checkpoint: throughput does not depend on the weights."""
    from torchcls.checkpoint.files import CheckpointMeta, save_weights
    from torchcls.data import Preprocess
    from torchcls.models.registry import ModelSpec, create_model

    spec = ModelSpec(model, classes, 3, img_size)
    meta = CheckpointMeta(spec, [f"class{i}" for i in range(classes)],
                          Preprocess(img_size, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), {}, 0, 0)
    path = folder / f"{model.replace('/', '_')}-{img_size}.safetensors"
    save_weights(path, create_model(spec).eval(), meta)
    return path


def raw_throughput(artifact, batch: int, seconds: float) -> float:
    """Images/s of the artifact called directly on batches of `batch` (median of 5 timed slices)."""
    pre = artifact.info.preprocess
    x = torch.randn(batch, pre.channels, pre.img_size, pre.img_size)
    artifact(x)
    rates, end = [], time.monotonic() + seconds
    while time.monotonic() < end or len(rates) < 5:
        t0 = time.perf_counter()
        artifact(x)
        rates.append(batch / (time.perf_counter() - t0))
    return statistics.median(rates)


def infer_request(port: int, name: str, shape: list[int]) -> bytes:
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": shape,
                                   "data": torch.randn(shape).flatten().tolist()}],
                       "outputs": [{"name": "probabilities"}, {"name": "labels"}]}).encode()
    head = (f"POST /v2/models/{name}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head + body


async def client(port: int, request: bytes, state: dict) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while state["sent"] < state["limit"] and time.monotonic() < state["deadline"]:
            state["sent"] += 1
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            status = int(lines[0].split()[1])
            headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            headers = {k.lower(): v for k, v in headers.items()}
            await reader.readexactly(int(headers["content-length"]))
            state["latencies" if status == 200 else "errors"].append(time.perf_counter() - t0)
            if status == 200:
                state["batch_sizes"].append(int(headers.get("x-batch-size", 0)))
    finally:
        writer.close()


async def load_level(port: int, request: bytes, concurrency: int, limit: int, seconds: float) -> dict:
    state = {"sent": 0, "limit": limit, "deadline": time.monotonic() + seconds, "latencies": [],
             "errors": [], "batch_sizes": []}
    t0 = time.perf_counter()
    await asyncio.gather(*(client(port, request, state) for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    lat = sorted(state["latencies"])
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")  # noqa: E731
    return {"images_per_s": len(lat) / elapsed, "p50_ms": pick(0.50), "p99_ms": pick(0.99), "ok": len(lat),
            "errors": len(state["errors"]),
            "mean_batch": statistics.fmean(state["batch_sizes"]) if state["batch_sizes"] else 0.0}


def wait_ready(proc: subprocess.Popen, url: str, log: Path, what: str) -> subprocess.Popen:
    """Poll `url` until it answers 200; a server that exits or stays unready for 5 minutes is stopped
    and its log's tail reported."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.25)
    stop(proc)
    raise SystemExit(f"{what} did not become ready at {url}: {log.read_text()[-2000:]}")


def start_server(artifact: str, port: int, max_batch: int, max_wait_ms: float, threads: int, log: Path,
                 *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torchcls", "serve", artifact, "--port", str(port), "--max-batch", str(max_batch),
           "--max-wait-ms", str(max_wait_ms), "--max-queue", "4096", "--threads", str(threads), *flags]
    return launch(cmd, f"http://127.0.0.1:{port}/v2/health/ready", log, "torchcls serve")


def start_litserve(artifact: str, port: int, max_batch: int, max_wait_ms: float, threads: int,
                   log: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).with_name("litserve_peer.py")), artifact, "--port", str(port),
           "--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms), "--threads", str(threads)]
    return launch(cmd, f"http://127.0.0.1:{port}/health", log, "the LitServe peer")


PEERS = {"litserve": start_litserve}  # name -> how to start it; each answers the same OIP infer request


def launch(cmd: list[str], ready_url: str, log: Path, what: str) -> subprocess.Popen:
    """Start a server in a process group of its own (servers such as LitServe spawn workers: stop() ends
    them all), its output in a file (a pipe nobody reads would block a chatty server once full)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return wait_ready(proc, ready_url, log, what)


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to the server's process group, SIGKILL to whatever of it is left after `timeout`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    while time.monotonic() < deadline:  # workers may outlive the leader by a moment
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(levels: list[dict], raw: float, peers: dict | None = None) -> str:
    """One row per level; with peers, a server column and each peer's row under the default server's."""
    servers = [("torchcls", levels)] + [(name, peer["levels"]) for name, peer in (peers or {}).items()]
    head = "| server " * bool(peers) + "| clients | images/s | vs raw | p50 ms | p99 ms | mean batch | errors |"
    rows = [head, "|---" * head.count("| ") + "|"]
    for i in range(len(levels)):
        for name, lvs in servers:
            lv = lvs[i]
            rows.append(f"| {name} " * bool(peers) + f"| {lv['concurrency']} | {lv['images_per_s']:.0f} | "
                        f"{lv['images_per_s'] / raw:.0%} | {lv['p50_ms']:.1f} | {lv['p99_ms']:.1f} | "
                        f"{lv['mean_batch']:.1f} | {lv['errors']} |")
    return "\n".join(rows)


def markdown(result: dict) -> str:
    from torchcls.machine import machine_line

    raw = result["raw_images_per_s"]
    text = (f"Machine: {machine_line(result['machine'])}\n\n"
            f"{result['model']} ({result['target']}, {result['input_shape']}): raw artifact at batch "
            f"{result['max_batch']}: {raw:.0f} images/s\n\n" + table(result["levels"], raw, result.get("peers")))
    if "model_process" in result:
        text += "\n\nThe model in a process of its own (--model-process):\n\n" + table(
            result["model_process"]["levels"], raw)
    return text


def summary(runs: dict[int, list[dict]], levels: list[int]) -> list[dict]:
    """Per level, the median of each figure over the rounds."""
    return [{"concurrency": c, **{k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]}} for c in levels]


def best_fraction(levels: list[dict], raw: float) -> float:
    return max(lv["images_per_s"] for lv in levels) / raw


def half_load_p99(levels: list[dict], raw_batch_ms: float) -> dict:
    """The p99 goal's reading: at the fewest clients that reach half of the best throughput, p99 over the
    raw artifact's batch latency (goal: <= 2)."""
    best = max(lv["images_per_s"] for lv in levels)
    level = min((lv for lv in levels if lv["images_per_s"] >= best / 2), key=lambda lv: lv["concurrency"])
    return {"concurrency": level["concurrency"], "p99_ms": level["p99_ms"],
            "p99_over_raw_batch": level["p99_ms"] / raw_batch_ms}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", nargs="?", help="artifact to serve (default: an untrained --model checkpoint)")
    p.add_argument("--model", default="smallnet")
    p.add_argument("--img-size", type=int, default=28)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=3000, help="most requests per level and round")
    p.add_argument("--seconds", type=float, default=8.0, help="most seconds per level and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=16, help="the server's batch bound = the raw baseline's batch")
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads for raw and server (0 = default)")
    p.add_argument("--compare-model-process", action="store_true",
                   help="also measure a server with --model-process, interleaved (JSON key model_process)")
    p.add_argument("--peers", default="", help=f"comma-separated other servers of the same artifact, measured "
                   f"interleaved (JSON key peers): {', '.join(PEERS)}")
    p.add_argument("--json-out", help="also write the JSON result here")
    args = p.parse_args()
    args.peers = [name for name in args.peers.split(",") if name]
    if unknown := sorted(set(args.peers) - set(PEERS)):
        p.error(f"--peers {','.join(unknown)}: choose among {', '.join(PEERS)}")
    return args


def start_all(args: argparse.Namespace, path: str, ports: dict[str, int], logs: Path) -> dict:
    """kind -> server process: default, process (--model-process), and each peer by name."""
    servers = {}
    try:
        for kind, port in ports.items():
            common = (path, port, args.max_batch, args.max_wait_ms, args.threads, logs / f"{kind}.log")
            if kind in PEERS:
                servers[kind] = PEERS[kind](*common)
            else:
                servers[kind] = start_server(*common, *(("--model-process",) if kind == "process" else ()))
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: dict) -> None:
    for server in servers.values():
        stop(server)


def measure(args: argparse.Namespace, artifact, ports: dict[str, int], requests: dict[str, bytes],
            levels: list[int]) -> tuple[list[float], dict]:
    """Interleaved: per round, the raw artifact, then each level against each server (the order of the
    servers alternating between rounds). Returns the raw rates and kind -> level -> results per round."""
    raws, runs = [], {kind: {c: [] for c in levels} for kind in ports}
    for i in range(args.rounds):
        raws.append(raw_throughput(artifact, args.max_batch, min(args.seconds, 3.0)))
        for c in levels:
            for kind in sorted(ports, reverse=i % 2 == 1):
                runs[kind][c].append(asyncio.run(load_level(ports[kind], requests[kind], c, args.requests,
                                                            args.seconds)))
    return raws, runs


def build_result(args: argparse.Namespace, info, raws: list[float], runs: dict, levels: list[int]) -> dict:
    from torchcls.machine import describe_machine

    pre = info.preprocess
    raw = statistics.median(raws)
    result = {
        "model": args.model if not args.artifact else info.name, "target": info.target,
        "input_shape": [1, pre.channels, pre.img_size, pre.img_size], "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "raw_images_per_s": raw,
        "raw_batch_ms": args.max_batch / raw * 1e3,  # the p99 goal is stated against it
        "levels": summary(runs["default"], levels),
        "machine": describe_machine(info.precision),  # a checkpoint runs in what --precision auto picks here
    }
    result["best_fraction_of_raw"] = best_fraction(result["levels"], raw)
    result["half_load_p99"] = half_load_p99(result["levels"], result["raw_batch_ms"])
    if "process" in runs:
        lv = summary(runs["process"], levels)
        result["model_process"] = {"levels": lv, "best_fraction_of_raw": best_fraction(lv, raw)}
    if args.peers:
        result["peers"] = {}
        for name in args.peers:
            lv = summary(runs[name], levels)
            result["peers"][name] = {"levels": lv, "best_fraction_of_raw": best_fraction(lv, raw)}
    return result


def report(result: dict) -> None:
    print(json.dumps(result, indent=2))
    print()
    print(markdown(result))
    print(f"\nbest server throughput = {result['best_fraction_of_raw']:.0%} of the raw artifact (goal: >= 85%)")
    half = result["half_load_p99"]
    print(f"p99 at half load ({half['concurrency']} clients) = {half['p99_over_raw_batch']:.1f}x the raw batch "
          f"latency of {result['raw_batch_ms']:.0f} ms (goal: <= 2x)")
    if "model_process" in result:
        print(f"with --model-process: {result['model_process']['best_fraction_of_raw']:.0%}")
    for name, peer in result.get("peers", {}).items():
        print(f"peer {name}: {peer['best_fraction_of_raw']:.0%} of the raw artifact")


def main() -> None:
    args = parse_args()
    from torchcls.artifacts.artifact import load_artifact

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        path = args.artifact or str(make_checkpoint(args.model, args.img_size, args.classes, Path(tmp)))
        artifact = load_artifact(path)
        info = artifact.info
        pre = info.preprocess
        kinds = ["default"] + ["process"] * args.compare_model_process + args.peers
        ports = {kind: free_port() for kind in kinds}
        levels = [int(c) for c in args.concurrency.split(",")]
        servers = start_all(args, path, ports, Path(tmp))
        try:
            shape = [1, pre.channels, pre.img_size, pre.img_size]
            requests = {kind: infer_request(port, info.name, shape) for kind, port in ports.items()}
            raws, runs = measure(args, artifact, ports, requests, levels)
        finally:
            stop_all(servers)
    result = build_result(args, info, raws, runs, levels)
    report(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

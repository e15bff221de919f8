"""`torchcls serve` as a real process on 127.0.0.1: OIP v2, /predict, batching, queue bound, errors, auth, shutdown."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")  # the 'serve' extra (also in 'test')

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, artifact: Path, *flags: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "torchcls", "serve", str(artifact), "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise AssertionError("server did not become ready")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def server(trained_run):
    # fp32: answers are checked against the eager fp32 model to 1e-4 (the default, auto, may serve bf16)
    s = Server(trained_run, "--max-batch", "8", "--max-wait-ms", "100", "--max-body-mb", "1", "--precision", "fp32")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def guarded(trained_run):
    """Token required, and a queue of 4 images that the batcher holds for 2.5 s (batch 16 never fills)."""
    s = Server(trained_run, "--max-batch", "16", "--max-queue", "4", "--max-wait-ms", "2500",
               env={"TORCHCLS_SERVE_TOKEN": TOKEN})
    yield s
    s.stop()


def images_of(trained_run: Path) -> list[tuple[Path, str]]:
    root = trained_run.parent.parent / "shapes"  # the image folder the conftest run was trained on
    return [(f, f.parent.name) for f in sorted(root.glob("*/*.png"))]


def preprocessed(trained_run: Path, files: list[Path]) -> torch.Tensor:
    from torchcls.checkpoint.files import load_model
    from torchcls.data import build_transform
    from torchcls.data.images import load_image

    _, meta = load_model(trained_run)
    t = build_transform(meta.preprocess, train=False)
    return torch.stack([t(load_image(f, meta.preprocess.channels)) for f in files])


def infer_body(x: torch.Tensor, **extra) -> dict:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.flatten().tolist()}], **extra}


def test_oip_metadata_health_and_infer_match_eager(server, trained_run):
    from torchcls.checkpoint.files import load_model

    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    model, meta = load_model(trained_run)
    md = httpx.get(f"{server.url}/v2/models/shapes").json()
    assert md["name"] == "shapes" and md["parameters"]["classes"] == meta.classes
    assert md["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    assert [o["name"] for o in md["outputs"]] == ["logits", "probabilities", "labels"]
    assert httpx.get(f"{server.url}/v2/models/shapes/ready").json()["ready"] is True

    files = [f for f, _ in images_of(trained_run)[::9]][:5]
    x = preprocessed(trained_run, files)
    with torch.no_grad():
        expected = model(x)
    r = httpx.post(f"{server.url}/v2/models/shapes/infer", json=infer_body(x, id="req-1"))
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert r.json()["id"] == "req-1" and out["logits"]["shape"] == [5, 2]
    logits = torch.tensor(out["logits"]["data"]).reshape(5, 2)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(out["probabilities"]["data"]).reshape(5, 2),
                               expected.softmax(1), atol=1e-5, rtol=1e-4)
    assert out["labels"]["data"] == [meta.classes[i] for i in expected.argmax(1).tolist()]

    # The binary tensor extension: the same tensor as raw FP32 bytes after the JSON header.
    header = ('{"inputs":[{"name":"input","datatype":"FP32","shape":[5,3,32,32],'
              f'"parameters":{{"binary_data_size":{x.numel() * 4}}}}}],"outputs":[{{"name":"logits"}}]}}').encode()
    r = httpx.post(f"{server.url}/v2/models/shapes/infer", content=header + x.numpy().astype("<f4").tobytes(),
                   headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 200, r.text
    assert [o["name"] for o in r.json()["outputs"]] == ["logits"]
    torch.testing.assert_close(torch.tensor(r.json()["outputs"][0]["data"]).reshape(5, 2), expected,
                               atol=1e-4, rtol=1e-4)


def test_predict_uploads_give_the_right_labels(server, trained_run):
    from torchcls.prediction import predict

    sample = images_of(trained_run)[::10]  # 8 images: the server's --max-batch binds one request too
    files = [("file", (f.name, f.read_bytes(), "image/png")) for f, _ in sample]
    too_many = files + files[:1]
    r = httpx.post(f"{server.url}/predict?topk=2", files=too_many)
    assert r.status_code == 400 and "max batch 8" in r.json()["error"], r.text
    r = httpx.post(f"{server.url}/predict?topk=2", files=files)
    assert r.status_code == 200, r.text
    got = [p["top"][0]["label"] for p in r.json()["predictions"]]
    local = predict(trained_run, [f for f, _ in sample], topk=2, precision="fp32")
    assert got == [item["top"][0]["label"] for item in local.items]
    assert [p["file"] for p in r.json()["predictions"]] == [f.name for f, _ in sample]
    truth = [label for _, label in sample]
    assert sum(g == t for g, t in zip(got, truth)) >= 0.75 * len(truth)  # a small model, briefly trained
    for p, item in zip(r.json()["predictions"], local.items):
        assert len(p["top"]) == 2 and abs(p["top"][0]["prob"] - item["top"][0]["prob"]) < 1e-4

    f, label = sample[0]  # a raw body is one image
    r = httpx.post(f"{server.url}/predict?topk=1", content=f.read_bytes())
    assert r.status_code == 200 and r.json()["predictions"][0]["top"][0]["label"] == got[0]


def test_concurrent_requests_are_batched(server, trained_run):
    x = preprocessed(trained_run, [f for f, _ in images_of(trained_run)[:1]])
    body = infer_body(x)
    with httpx.Client(limits=httpx.Limits(max_connections=32)) as client, ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: client.post(f"{server.url}/v2/models/shapes/infer", json=body,
                                                        timeout=60), range(16)))
    assert all(r.status_code == 200 for r in responses)
    sizes = [int(r.headers["x-batch-size"]) for r in responses]
    assert max(sizes) > 1 and max(sizes) <= 8, sizes
    text = httpx.get(f"{server.url}/metrics").text
    count = float(re.search(r"^torchcls_batch_size_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^torchcls_batch_size_sum (\S+)$", text, re.M).group(1))
    assert total > count  # some model calls ran more than one image
    assert re.search(r'^torchcls_requests_total\{endpoint="/v2/models/\{model_name\}/infer",status="200"\} '
                     r'(\d+)', text, re.M)
    assert "torchcls_request_duration_seconds_bucket" in text and "torchcls_queue_depth" in text


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, trained_run):
    url = f"{server.url}/v2/models/shapes/infer"
    x = torch.zeros(1, 3, 32, 32)
    good = infer_body(x)
    bad_bodies = {
        "wrong shape": infer_body(torch.zeros(1, 3, 28, 28)),
        "wrong datatype": {"inputs": [{**good["inputs"][0], "datatype": "INT64"}]},
        "strings as data": {"inputs": [{**good["inputs"][0], "data": ["a"] * 3072}]},
        "too few values": {"inputs": [{**good["inputs"][0], "data": [0.0] * 10}]},
        "batch above the bound": {"inputs": [{**good["inputs"][0], "shape": [65, 3, 32, 32], "data": [0] * 3}]},
        "no inputs": {"outputs": []},
        "unknown output": {**good, "outputs": [{"name": "embeddings"}]},
        # A repeated output used to be serialised once per mention (a 361 KB request -> 3.26 MB answer).
        "duplicate outputs": {**good, "outputs": [{"name": "probabilities"}] * 2},
        # --max-batch 8 binds a single request too, not only the batches the batcher forms.
        "batch above --max-batch": infer_body(torch.zeros(9, 3, 32, 32)),
    }
    for what, body in bad_bodies.items():
        r = httpx.post(url, json=body)
        assert r.status_code == 400, (what, r.text)
        assert r.json()["error"], what
    assert httpx.post(url, content=b"{not json").status_code == 400
    assert httpx.post(f"{server.url}/v2/models/nope/infer", json=good).status_code == 404
    assert httpx.get(f"{server.url}/v2/models/nope").status_code == 404
    r = httpx.post(f"{server.url}/predict", content=b"these bytes are not an image")
    assert r.status_code == 400 and "not an image" in r.json()["error"]
    assert httpx.post(f"{server.url}/predict", content=b"").status_code == 400
    assert httpx.post(f"{server.url}/predict?topk=x", content=b"x").status_code == 400
    r = httpx.post(url, content=b"0" * (2 * 2**20))  # above --max-body-mb 1
    assert r.status_code == 413 and "limit" in r.json()["error"]
    assert httpx.post(url, json=good).status_code == 200  # still serving


def _answers(sock: socket.socket, request: bytes, n: int) -> list[bytes]:
    """Send `request` and read `n` answers (head, then a body of its Content-Length): their heads, lowercased."""
    sock.sendall(request)
    buf, heads = b"", []
    while len(heads) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(heads)} of {n} answers: {buf!r}"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        size = int(re.search(rb"\r\ncontent-length: (\d+)", head, re.I).group(1))
        while len(buf) < size:
            chunk = sock.recv(65536)
            assert chunk, f"closed in answer {len(heads) + 1}'s body: {head!r}"
            buf += chunk
        heads.append(head.lower())
        buf = buf[size:]
    return heads


def test_an_answer_given_before_the_body_is_in_closes_the_connection(server):
    """A request refused before its body was read (404: no such model; 401 and 503 alike) is answered with
    `Connection: close`, as the server then closes the connection: a pooled client that was not told sent its
    next request into it ("Server disconnected without sending a response", seen under a full queue's 503s).
    Requests without a body keep their connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        heads = _answers(sock, b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n[[[", 1)
        assert heads[0].startswith(b"http/1.1 404") and b"\r\nconnection: close" in heads[0], heads
        assert sock.recv(1) == b""  # the server closed it (a socket timeout fails here)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        heads = _answers(sock, b"GET /v2/models/nope HTTP/1.1\r\nHost: x\r\n\r\n"
                               b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                               b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n", 3)
        assert [h[:12] for h in heads] == [b"http/1.1 404", b"http/1.1 404", b"http/1.1 200"]
        assert not any(b"connection: close" in h for h in heads)
        heads = _answers(sock, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n", 1)  # still open
        assert heads[0].startswith(b"http/1.1 200")


def _server_memory_mb(pid: int, field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def test_hostile_ico_uploads_get_400_and_the_server_stays_small(server):
    """Issue 30, finding 2: two concurrent uploads of an .ico whose 16x16 entry embeds a 30000x30000 PNG took a
    server from 757 MiB to 4.25 GB and answered 500; each is now refused from its headers, nothing decoded."""
    from test_image_bounds import hostile_ico

    ico = hostile_ico(zeros_mb=800)  # ~830 KB, under --max-body-mb 1; it used to inflate 800 MiB of rows
    assert len(ico) < 2**20 - 4096
    Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")  # its peak RSS from here on
    before = _server_memory_mb(server.proc.pid, "VmRSS")
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{server.url}/predict", files={"file": ("favicon.ico", ico)},
                                                      timeout=60), range(2)))
    grew = _server_memory_mb(server.proc.pid, "VmHWM") - before
    assert grew < 100, f"the server's peak RSS grew {grew:.0f} MB"
    for r in answers:
        assert r.status_code == 400 and "entry 1 embeds a 30000x30000 PNG" in r.json()["error"], r.text
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200


def test_token_is_required(guarded):
    assert httpx.get(f"{guarded.url}/v2/health/ready").status_code == 200  # probes stay open
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{guarded.url}/v2/models/shapes", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{guarded.url}/v2/models/shapes", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def _infer_many(url: str, n: int, x: torch.Tensor) -> list:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(limits=httpx.Limits(max_connections=n), headers=auth, timeout=60) as client, \
            ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: client.post(f"{url}/v2/models/shapes/infer", json=infer_body(x)), range(n)))


def test_full_queue_answers_503_and_accepted_requests_are_answered(guarded, trained_run):
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    responses = _infer_many(guarded.url, 12, x)
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 4 and codes.count(503) >= 1, codes
    for r in responses:
        if r.status_code == 503:
            assert "queue is full" in r.json()["error"] and r.headers["retry-after"] == "1"
    labels = {tuple(r.json()["outputs"][2]["data"]) for r in responses if r.status_code == 200}
    assert len(labels) == 1 and len(labels.pop()) == 1  # the same image: the same single label each time


def test_shutdown_answers_accepted_requests(guarded, trained_run):
    """SIGTERM while 3 requests wait in the batcher: all 3 are answered, then the process exits 0."""
    x = preprocessed(trained_run, [images_of(trained_run)[0][0]])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_infer_many, guarded.url, 3, x)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = httpx.get(f"{guarded.url}/metrics", headers=auth).text
            if re.search(r"^torchcls_queue_depth 3\.0$", text, re.M):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the 3 requests never showed up in the queue")
        guarded.proc.send_signal(signal.SIGTERM)
        responses = pending.result(timeout=60)
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert guarded.proc.wait(timeout=60) == 0


def test_missing_artifact_exits_2():
    r = subprocess.run([sys.executable, "-m", "torchcls", "serve", "no/such/run", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "torchcls serve: error: artifact no/such/run does not exist" in r.stderr and "Traceback" not in r.stderr


def test_mismatched_artifact_exits_2(tmp_path, capsys):
    from torchcls.cli import main

    bad = tmp_path / "not-a-checkpoint.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    assert main(["serve", str(bad), "--port", str(free_port())]) == 2
    assert "not a safetensors checkpoint" in capsys.readouterr().err


def test_model_process_serves_the_same_logits_and_stops_with_the_server(trained_run):
    """--model-process: the model runs in a child process; same answers, and SIGTERM stops both (exit 0)."""
    psutil = pytest.importorskip("psutil")
    from torchcls.checkpoint.files import load_model

    s = Server(trained_run, "--model-process", "--max-batch", "8", "--threads", "1", "--precision", "fp32")
    try:
        children = psutil.Process(s.proc.pid).children()
        assert [c.cmdline()[1:3] for c in children] == [["-m", "torchcls.serve.worker"]]
        model, _ = load_model(trained_run)
        x = preprocessed(trained_run, [f for f, _ in images_of(trained_run)[::9]][:5])
        with torch.no_grad():
            expected = model(x)
        r = httpx.post(f"{s.url}/v2/models/shapes/infer", json=infer_body(x), timeout=60)
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        torch.testing.assert_close(torch.tensor(out["logits"]["data"]).reshape(5, 2), expected, atol=1e-4, rtol=1e-4)
        r = httpx.post(f"{s.url}/predict?topk=1", content=images_of(trained_run)[0][0].read_bytes(), timeout=60)
        assert r.status_code == 200 and len(r.json()["predictions"][0]["top"]) == 1
        r = httpx.post(f"{s.url}/v2/models/shapes/infer", json=infer_body(torch.zeros(9, 3, 32, 32)))
        assert r.status_code == 400  # validated in the server, before the model process
    finally:
        assert s.stop() == 0
    psutil.wait_procs(children, timeout=30)
    assert not any(c.is_running() for c in children)

"""The HTTP app: Open Inference Protocol v2 endpoints, /predict for image uploads, /metrics.

Requests are refused (503) before any parsing when the model cannot take them; bodies are
parsed and images decoded in worker threads, and every fault is a 4xx naming what was wrong.
The model runs in the batcher's worker thread, or (--model-process) in a process of its own
(serve/worker.py) that the batcher thread feeds, so that it never waits for this process's GIL.
On a GPU (--device), each batch the batcher forms goes to the device through the artifact's one
pinned host buffer (LoadedArtifact.to_device: an asynchronous DMA copy) and the logits come back
to the host before the results are handed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from torchcls.artifacts.artifact import ArtifactInfo, LoadedArtifact
from torchcls.data import build_transform
from torchcls.data.images import BadImage, decode_bytes
from torchcls.errors import UserError
from torchcls.options import check_options
from torchcls.serve import oip
from torchcls.serve.batcher import DynamicBatcher, QueueFull
from torchcls.serve.deadlines import ClientDeadlines, RequestLimits
from torchcls.serve.http_errors import HTTPError
from torchcls.serve.limits import AuthMiddleware, BodyGuard, InflightBudget
from torchcls.serve.metrics import MetricsMiddleware, ServeMetrics
from torchcls.serve.serve_config import ServeConfig
from torchcls.tasks import labels_above

log = logging.getLogger("torchcls.serve")
PUBLIC_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})  # probes carry no token
PROBE_PATHS = PUBLIC_PATHS | {"/metrics"}  # answered at any load: no body, no model


def json_response(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": message}, status, headers)


def create_app(artifact: LoadedArtifact, cfg: ServeConfig, token: str | None = None,
               on_ready: Callable[[BaseException | None], None] = lambda e: None,
               model_path: str | Path | None = None) -> FastAPI:
    """The app serving `artifact`; with `model_path` (the artifact's file) and `cfg.model_process`, the model
    runs in a child process that loads it from that file."""
    check_options(cfg, "serve")  # (serve() did; an app built from Python too: a NaN rate would switch its limit off)
    info = artifact.info
    metrics = ServeMetrics()
    batcher = DynamicBatcher(artifact, max_batch=cfg.max_batch or info.max_batch, max_wait_s=cfg.max_wait_ms / 1e3,
                             max_queue=cfg.max_queue, on_batch=metrics.observe_batch,
                             on_depth=metrics.queue_depth.set, multilabel=info.task == "multilabel")
    svc = Service(cfg.name or info.name, info, batcher)
    pre = info.preprocess
    shape = (pre.channels, pre.img_size, pre.img_size)
    max_body = int(cfg.max_body_mb * 2**20)
    budget = InflightBudget(int(cfg.max_inflight_mb * 2**20), max_body, pace_s=cfg.body_timeout)
    metrics.inflight_bytes.set_function(lambda: budget.used)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = start_model_process(batcher, cfg, model_path, artifact) if model_path is not None else None
        # Warm up with the smallest and largest batch: compiled artifacts specialise on first calls.
        batcher.start([torch.zeros(1, *shape), torch.zeros(batcher.max_batch, *shape)], on_ready)
        yield
        batcher.close(timeout=cfg.graceful_timeout)  # the server has already let in-flight requests finish
        if worker is not None:
            worker.close()

    app = FastAPI(title="torchcls serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  **telemetry_options())
    app.state.batcher, app.state.metrics = batcher, metrics
    app.add_middleware(BodyGuard, max_bytes=max_body, budget=budget)
    if token:
        app.add_middleware(AuthMiddleware, token=token, public=PUBLIC_PATHS, compare=secrets.compare_digest)
    app.add_middleware(ClientDeadlines, limits=request_limits(cfg), exempt=PROBE_PATHS,
                       on_cut=lambda reason: metrics.closed.labels(reason).inc())
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # added last = outermost: sees 401/413/408 too
    add_error_handlers(app)
    add_info_routes(app, svc, metrics)
    add_inference_routes(app, svc, max_body)
    return app


def telemetry_options() -> dict:
    """FastAPI's native OpenTelemetry (its `telemetry` option, newer releases) asks for the global providers on
    every request: an os.environ lookup each, 8% of the GIL under load (py-spy, 32 clients). A server's
    providers are configured before it starts (OTEL_PYTHON_*_PROVIDER, or code that runs first), so ask once:
    each signal stays on only where a provider is configured now."""
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    from opentelemetry import metrics, trace  # FastAPI's own dependency wherever it has the option

    def configured(provider: object) -> bool:  # the API's stand-ins until an SDK is set: proxies and no-ops
        name = type(provider).__name__
        return "Proxy" not in name and "NoOp" not in name

    return {"telemetry": {"tracing": configured(trace.get_tracer_provider()),
                          "metrics": configured(metrics.get_meter_provider()),
                          "logs": "OTEL_PYTHON_LOGGER_PROVIDER" in os.environ}}


def request_limits(cfg: ServeConfig) -> RequestLimits:
    return RequestLimits(cfg.max_connections, int(cfg.max_header_kb * 1024), cfg.body_timeout,
                         cfg.min_body_rate_kb * 1024, cfg.send_timeout)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> Response:
        return error_response(e.status, e.message, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(e.status_code, str(e.detail), getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        return error_response(400, f"bad request: {problems}")

    @app.exception_handler(UserError)
    async def _user_error(request: Request, e: UserError) -> Response:
        return error_response(400, str(e))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        log.exception("request %s failed", request.url.path)
        return error_response(500, "internal error; the server log has the details")  # no internals to clients


class Service:
    """What the routes share: the model's name and metadata, the batcher, admission and the decode stage."""

    def __init__(self, name: str, info: ArtifactInfo, batcher: DynamicBatcher):
        self.name, self.info, self.batcher = name, info, batcher
        self.transform = build_transform(info.preprocess, train=False)
        # Decoding and JSON parsing run in worker threads, never on the event loop (health probes stay
        # prompt); at most one decode per core at a time so uploads cannot pile up decoded copies. Two
        # pools: slow image decodes (seconds for a 64 MP 16-bit PNG) must not hold up JSON requests.
        self.decode_slots = asyncio.Semaphore(os.cpu_count() or 1)
        self.parse_slots = asyncio.Semaphore(os.cpu_count() or 1)

    def check_model(self, model_name: str) -> None:
        if model_name != self.name:
            raise HTTPError(404, f"unknown model {model_name!r}; this server serves {self.name!r}")

    def admit(self, n: int = 1) -> None:
        """Refuse (503) before any parsing or decoding when the model cannot take the work now."""
        if not self.batcher.ready.is_set():
            raise HTTPError(503, "the model is still warming up; poll /v2/health/ready", {"Retry-After": "1"})
        try:
            self.batcher.check_room(n)
        except QueueFull as e:
            raise HTTPError(503, str(e), {"Retry-After": "1"}) from None

    async def run(self, x: torch.Tensor):
        self.admit(len(x))
        try:
            return await self.batcher.submit(x)
        except QueueFull as e:
            raise HTTPError(503, str(e), {"Retry-After": "1"}) from None

    async def off_loop(self, slots: asyncio.Semaphore, fn, *args):
        async with slots:
            return await run_in_threadpool(fn, *args)

    def decode_all(self, uploads: list[tuple[str, bytes]]) -> torch.Tensor:
        pre = self.info.preprocess
        tensors = []
        for fname, data in uploads:
            try:  # the decoder every file goes through; min_side bounds the resize
                tensors.append(self.transform(decode_bytes(data, pre.channels, pre.resize_size)))
            except BadImage as e:
                raise HTTPError(400, f"{fname}: {e}") from None
        return torch.stack(tensors)


def probe_answers(ready_now: Callable[[], bool], metrics: ServeMetrics) -> dict[str, Callable]:
    """path -> the coroutine function answering GET on it: the health probes and /metrics, the same on the API's
    port and on --probe-port's, whose thread calls them too (they only read an Event and prometheus_client's
    locked values)."""

    async def live() -> Response:
        return json_response({"live": True})

    # The protocol answers health questions with the status: 200 = true, 4xx = false.
    async def ready() -> Response:
        return json_response({"ready": ready_now()}, 200 if ready_now() else 400)

    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return {"/v2/health/live": live, "/v2/health/ready": ready, "/metrics": prometheus}


def add_info_routes(app: FastAPI, svc: Service, metrics: ServeMetrics) -> None:
    ready_now = svc.batcher.ready.is_set

    @app.get("/v2")
    async def server_metadata() -> Response:
        from torchcls.version import __version__

        return json_response({"name": "torchcls", "version": __version__, "extensions": ["binary_tensor_data"]})

    app.state.probes = probe_answers(ready_now, metrics)  # also served on --probe-port (serve/probes.py)
    for path, answer in app.state.probes.items():
        app.get(path)(answer)

    @app.get("/v2/models/{model_name}")
    async def model_metadata(model_name: str) -> Response:
        svc.check_model(model_name)
        return json_response(oip.model_metadata(svc.name, svc.info))

    @app.get("/v2/models/{model_name}/ready")
    async def model_ready(model_name: str) -> Response:
        svc.check_model(model_name)
        return json_response({"name": svc.name, "ready": ready_now()}, 200 if ready_now() else 400)


def add_inference_routes(app: FastAPI, svc: Service, max_body: int) -> None:
    info, max_batch = svc.info, svc.batcher.max_batch

    @app.post("/v2/models/{model_name}/infer")
    async def infer(model_name: str, request: Request) -> Response:
        svc.check_model(model_name)
        svc.admit()
        body = await read_body(request)
        x, req = await svc.off_loop(svc.parse_slots, oip.parse_infer, body, request.headers.get(oip.BINARY_HEADER),
                                    info, max_batch)
        outputs = oip.requested_outputs(req)
        binary = oip.binary_outputs(req, outputs)
        result = await svc.run(x)
        body, header_length = oip.infer_response(svc.name, req, outputs, result.logits, result.probs, result.top1,
                                                 info.classes, oip.thresholds(info), binary)
        headers = {"X-Batch-Size": str(result.batch_size)}
        if header_length is None:
            return json_response(body, headers=headers)
        headers["Inference-Header-Content-Length"] = str(header_length)
        return Response(body, media_type="application/octet-stream", headers=headers)

    @app.post("/predict")
    async def predict(request: Request, topk: int = 5) -> Response:
        if topk < 1:
            raise HTTPError(400, f"topk must be at least 1, got {topk}")
        svc.admit()
        uploads = await read_uploads(request, max_files=max_batch, max_part_bytes=max_body)
        if len(uploads) > max_batch:
            raise HTTPError(400, f"{len(uploads)} images are above this server's max batch {max_batch}")
        svc.admit(len(uploads))
        x = await svc.off_loop(svc.decode_slots, svc.decode_all, uploads)
        result = await svc.run(x)
        predictions = [{"file": fname, "top": top} for (fname, _), top in
                       zip(uploads, top_k(result.probs, topk, info.classes))]
        if info.task == "multilabel":  # every label at or above its threshold
            for p, probs in zip(predictions, result.probs.tolist()):
                p["labels"] = labels_above(probs, oip.thresholds(info).tolist(), info.classes)
        return json_response({"model_name": svc.name, "predictions": predictions},
                             headers={"X-Batch-Size": str(result.batch_size)})


def wants_model_process(cfg: ServeConfig, artifact: LoadedArtifact) -> tuple[bool, str]:
    """--model-process, or its default here, and why."""
    if cfg.model_process is not None:
        return cfg.model_process, "--model-process" if cfg.model_process else "--no-model-process"
    if artifact.runs_on.type != "cpu":
        return False, f"the model runs on {artifact.runs_on}, not on the CPU the HTTP side uses"
    from torchcls.machine import cpu_budget

    budget = cpu_budget()
    if budget.usable < 2:
        return False, f"{budget.describe()}: nothing for a second process to run on"
    return True, f"{budget.describe()}: the model never waits for the GIL the HTTP side holds"


def start_model_process(batcher: DynamicBatcher, cfg: ServeConfig, model_path: str | Path,
                        artifact: LoadedArtifact):
    """The batcher's model becomes a child process that loads `model_path`, where wants_model_process says."""
    wanted, why = wants_model_process(cfg, artifact)
    log.info("model %s (%s)", "in a process of its own" if wanted else "in a thread of the server", why)
    if not wanted:
        return None
    from torchcls.serve.worker import ModelProcess

    worker = ModelProcess(model_path, cfg.expect_sha256, cfg.threads, cfg.device, cfg.trust_artifact,
                          precision=cfg.precision)
    batcher.fn = worker
    return worker


def top_k(probs: np.ndarray, k: int, classes: list[str]) -> list[list[dict]]:
    """Per image, the k most probable classes (numpy: no torch call on the event loop)."""
    indices = np.argsort(-probs, axis=1, kind="stable")[:, :min(k, len(classes))]
    values = np.take_along_axis(probs, indices, axis=1)
    return [[{"label": classes[i], "prob": round(v, 6)} for v, i in zip(vals.tolist(), idx.tolist())]
            for vals, idx in zip(values, indices)]


async def read_uploads(request: Request, max_files: int, max_part_bytes: int) -> list[tuple[str, bytes]]:
    """(file name, bytes) of every uploaded file: multipart form files, or the raw body as one image."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        # Starlette's default part limit (1 MiB) would refuse ordinary photos: the body limit governs.
        form = await request.form(max_files=max_files + 1, max_part_size=max_part_bytes)
        uploads = [(v.filename or k, await v.read()) for k, v in form.multi_items() if isinstance(v, UploadFile)]
        if not uploads:
            raise HTTPError(400, "the multipart form holds no file; send the image as a file field")
        return uploads
    body = await read_body(request)
    if not body:
        raise HTTPError(400, "the request body is empty; send image bytes (raw body or multipart file)")
    return [("body", bytes(body))]


async def read_body(request: Request) -> bytearray:
    """The whole body in one growing buffer: one copy in memory (Starlette's request.body() joins a list
    of chunks, twice the body at its peak). Never sized from Content-Length up front: a client that
    declares 31 MiB and sends nothing would make it allocate 31 MiB that BodyGuard's budget never saw."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
    return buf

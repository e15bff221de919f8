"""`torchcls serve`: load the artifact (errors end here, before any socket), then run it on Hypercorn."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from torchcls.errors import UserError
from torchcls.extras import missing_extra
from torchcls.options import check_options
from torchcls.serve.run_loop import hypercorn_config, run_until
from torchcls.serve.serve_config import TOKEN_ENV, ServeConfig

log = logging.getLogger("torchcls.serve")
# How long a thread waiting for the GIL lets the holder run before asking for it (CPython's default:
# 5 ms). An eager model releases the GIL in every operator and must take it back before the next:
# with the event loop and JSON parsing holding it most of the time under load, each of ResNet-18's
# ~70 operators per batch could wait up to 5 ms. 0.2 ms bounds that wait (a forced switch costs a
# few microseconds); C calls that hold the GIL (orjson, numpy) still run to their end.
GIL_SWITCH_INTERVAL_S = 0.0002


def _check(cfg: ServeConfig, artifact_max_batch: int) -> None:
    """What no single range says: how the options and the artifact fit together (each number is within its
    ServeConfig bound already, so finite)."""
    if cfg.probe_port == cfg.port != 0:
        raise UserError(f"--probe-port {cfg.probe_port} is --port's: the probe port must be another one (leave "
                        "--probe-port out to answer the probes on --port only)")
    if not 0 <= cfg.max_batch <= artifact_max_batch:
        raise UserError(f"--max-batch {cfg.max_batch} must be between 1 and the artifact's max batch "
                        f"{artifact_max_batch} (0 = use the artifact's)")
    if not cfg.max_body_mb <= cfg.max_inflight_mb:
        raise UserError(f"--max-body-mb {cfg.max_body_mb:g} is above --max-inflight-mb {cfg.max_inflight_mb:g}: "
                        "a body that large could never be read; raise --max-inflight-mb or lower --max-body-mb")


def _bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    """Bind here so that a busy port is a clear message, not a server traceback."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another {flag} or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(artifact_path: str | Path, cfg: ServeConfig) -> None:
    check_options(cfg, "serve")  # every number finite and in its range, before anything is loaded
    if not Path(artifact_path).exists():  # answer at once, before paying for importing torch
        raise UserError(f"artifact {artifact_path} does not exist; pass a .pt2, .onnx or .safetensors file "
                        "or a run dir (`torchcls train` writes run dirs under runs/)")
    try:
        import fastapi  # noqa: F401
        import hypercorn  # noqa: F401
    except ImportError as e:
        raise missing_extra("serve", "torchcls serve", e.name) from None
    import torch

    from torchcls.artifacts.artifact import load_artifact
    from torchcls.serve.app import create_app
    from torchcls.serve.probes import start_probe_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from torchcls.provenance.sidecars import refuse_forbidden_predictions

    refuse_forbidden_predictions(artifact_path, "serve")  # a policy's [outputs] predictions = false
    artifact = load_artifact(artifact_path, expect_sha256=cfg.expect_sha256, device=cfg.device, trust=cfg.trust_artifact,
                             precision=cfg.precision)
    if getattr(artifact, "choice", None) is not None:  # a checkpoint: say what --precision chose and why
        log.info("%s: %s", artifact_path, artifact.choice.line())
    if artifact.trust:
        log.info("%s: loading its native code: %s", artifact_path, artifact.trust)
    _check(cfg, artifact.info.max_batch)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    token = cfg.token or os.environ.get(TOKEN_ENV) or None
    sock = _bind(cfg.host, cfg.port)
    probe_sock = _bind(cfg.host, cfg.probe_port, "--probe-port") if cfg.probe_port is not None else None
    failure: list[BaseException] = []
    name = cfg.name or artifact.info.name
    url = f"http://{cfg.host}:{sock.getsockname()[1]}"
    stop = threading.Event()  # set by SIGINT/SIGTERM or a failed warm-up: drain, then exit

    def on_ready(error: BaseException | None) -> None:
        if error is None:
            log.info("model %r (%s %s on %s, max batch %d) ready on %s/v2/models/%s", name, artifact.info.target,
                     artifact.info.precision, artifact.runs_on, artifact.info.max_batch, url, name)
            return
        failure.append(error)
        stop.set()  # warm-up failed: the artifact cannot serve

    app = create_app(artifact, cfg, token=token, on_ready=on_ready, model_path=artifact_path)
    log.info("warming up %s; listening on %s (auth %s)", artifact_path, url, "on" if token else "off")
    stopped_by: list[int] = []
    probes = start_probe_server(app, probe_sock, token) if probe_sock is not None else None
    try:
        run_until(app, hypercorn_config(sock, cfg.header_timeout, cfg.max_header_kb, cfg.graceful_timeout), stop,
                  stopped_by)
    finally:
        if probes is not None:
            probes.stop()  # after the drain: the probes are answered until the last accepted request is
    if stopped_by:
        log.info("stopped by %s after answering every accepted request", signal.Signals(stopped_by[0]).name)
    if failure:
        raise UserError(f"{artifact_path}: warm-up inference failed ({failure[0]}); the artifact cannot be served")

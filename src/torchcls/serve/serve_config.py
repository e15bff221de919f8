"""Options of `torchcls serve`, declared once: the CLI builds its flags from these fields, and serve() checks each
number against its `bound` (options.check_options) before anything is loaded."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

from torchcls.config import INT_RANGES, FloatRange, IntRange, opt

TOKEN_ENV = "TORCHCLS_SERVE_TOKEN"
# Ranges as config's INT_RANGES / FLOAT_RANGES declare them. Each bound is finite and excludes NaN: a NaN rate or
# timeout fails every comparison, so `nan <= 0` let it through and the limit it set was silently off.
TCP_PORT = IntRange(0, 65535, "a TCP port; 0 = a free one")
SECONDS = FloatRange("(0, 86400]", "seconds: up to a day")
MIB = FloatRange("(0, 65536]", "MiB: up to 64 GiB")


@dataclass
class ServeConfig:
    host: str = opt("127.0.0.1", "address to listen on (localhost by default; 0.0.0.0 exposes the server)")
    port: int = opt(8080, "TCP port", bound=TCP_PORT)
    probe_port: int | None = opt(None, "also answer the health probes and /metrics (nothing else) on this TCP port, "
                                 "from a thread and event loop of their own with short header bounds, so that "
                                 "load on --port cannot delay them (Kubernetes probes time out after 1 s). Same "
                                 "--host; default: off (they are always answered on --port as well)", bound=TCP_PORT)
    token: str | None = opt(None, "require 'Authorization: Bearer TOKEN' on every endpoint except the health "
                            f"probes (default: the {TOKEN_ENV} environment variable; unset = no auth)")
    name: str | None = opt(None, "model name in /v2/models/NAME (default: the artifact's name)")
    max_batch: int = opt(0, "largest batch the dynamic batcher forms (0 = the artifact's max batch)",
                         bound=IntRange(0, 4096, "no artifact takes more: artifacts/targets/base.MAX_BATCH"))
    max_wait_ms: float = opt(5.0, "how long the batcher waits for more requests after the first one",
                             bound=FloatRange("[0, 60000]", "milliseconds: up to a minute"))
    max_queue: int = opt(256, "images accepted but not yet running; requests beyond it get 503",
                         bound=IntRange(1, 1 << 20, "images held decoded"))
    max_body_mb: float = opt(32.0, "largest request body in MiB; bigger ones get 413", bound=MIB)
    max_connections: int = opt(1024, "requests in progress at once; at the cap a new request cuts the body "
                               "furthest behind --min-body-rate-kb (408), else it gets 503 at once instead of "
                               "queueing without bound (health probes and /metrics are always answered). Open "
                               "connections themselves are not capped: put a proxy in front for that",
                               bound=IntRange(1, 1 << 20, "requests in progress, a buffer each"))
    max_inflight_mb: float = opt(256.0, "request body bytes held at once by all requests together (counted as "
                                 "they arrive); a body that does not fit gets 503 with Retry-After, refused before "
                                 "it is read when its Content-Length says so", bound=MIB)
    max_header_kb: float = opt(16.0, "largest request line + headers in KiB (and at most 100 header lines); "
                               "beyond it 431 and the connection closes",
                               bound=FloatRange("[1, 1024]", "KiB read per connection before a request is known"))
    header_timeout: float = opt(10.0, "seconds a client has to send a request's headers, counted from its "
                                "connection or its previous answer; then the connection is closed", bound=SECONDS)
    body_timeout: float = opt(60.0, "seconds a client has to send a request's whole body once its headers are "
                              "in; then 408 and the connection closes", bound=SECONDS)
    min_body_rate_kb: float = opt(1.0, "slowest request body accepted, in KiB/s averaged since its headers (time "
                                  "the server was not waiting for it does not count): after a 2 s grace, a body "
                                  "that fell behind it gets 408; at --max-connections, the body furthest below it "
                                  "is cut (408) to make room for a new request. 0 = no minimum",
                                  bound=FloatRange("[0, 1e6]", "KiB/s: 0 = no minimum, up to about 1 GiB/s"))
    send_timeout: float = opt(30.0, "seconds one send of an answer may wait for its client to read (the write "
                              "buffer full all along); then the request ends and its slot is given back",
                              bound=SECONDS)
    graceful_timeout: float = opt(30.0, "seconds allowed on shutdown to answer the requests already accepted",
                                  bound=FloatRange("[0, 86400]", "seconds: up to a day"))
    device: str = opt("auto", "where the model runs: auto (a .pt2 where it was built; otherwise cuda when a GPU is "
                      "visible), cpu, cuda or cuda:N. On a GPU, batches reach it through pinned host memory")
    threads: int = opt(0, "intra-op CPU threads for the model (0 = torch default)",
                       bound=INT_RANGES[("train", "threads")])
    precision: str = opt("auto", "what a checkpoint (.safetensors or run dir) is served in: auto = bf16 where the "
                         "hardware computes it natively (CPU with AVX-512-bf16 or AMX, GPU of compute capability "
                         ">= 8.0), else fp32; an exported artifact keeps the precision it was exported in",
                         choices=("auto", "fp32", "bf16"))
    model_process: bool | None = opt(None, "run the model in a process of its own, fed by the batcher: it never "
                                     "waits for the GIL that request parsing holds, at the cost of a second "
                                     "interpreter's memory and a copy per batch. Default: on where the model runs "
                                     "on the CPU and this process may use 2 or more CPUs (measured on 2 cores: 385 "
                                     "images/s against 267 in one process, docs/serving.md), off "
                                     "otherwise; --no-model-process keeps it in a thread of the server")
    expect_sha256: str | None = opt(None, "refuse to load the artifact unless its file has this SHA-256 (a .pt2 "
                                    "is native code; default: the digest governance registered for it, if any)")
    trust_artifact: bool = opt(False, "load a .pt2 that nothing vouches for (not exported on this machine, no "
                               "--expect-sha256, no registration under your audit key): it is native code, run as "
                               "soon as it is loaded; only for a file you trust")


def field_types() -> dict[str, type]:
    """Each field's concrete type (X | None -> X), for building CLI flags."""
    hints = typing.get_type_hints(ServeConfig)
    out = {}
    for f in dataclasses.fields(ServeConfig):
        t = hints[f.name]
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            t = next(a for a in typing.get_args(t) if a is not type(None))
        out[f.name] = t
    return out

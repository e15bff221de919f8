"""Serving: an HTTP endpoint (Open Inference Protocol v2 + /predict) with a dynamic batcher.

Heavy imports (torch, FastAPI, Hypercorn) happen inside `serve`, so the CLI can read
`ServeConfig` cheaply.
"""

from __future__ import annotations

from typing import Any

from torchcls.serve.serve_config import ServeConfig

__all__ = ["ServeConfig", "serve"]


def serve(artifact: Any, cfg: ServeConfig | None = None) -> None:
    from torchcls.serve.server import serve as _serve

    _serve(artifact, cfg or ServeConfig())

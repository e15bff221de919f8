"""Artifacts: one exporter for every target (AOTInductor, ONNX, ExecuTorch; early-exit models
included), parity against eager, inference compile, and one loader for all of them.

Light to import: submodules are loaded on first use (importing torchcls.artifacts.parity imports
nothing else of the package).
"""

from __future__ import annotations

from torchcls.lazy import lazy_api

_API = {
    "ArtifactInfo": "torchcls.artifacts.targets.base",
    "LoadedArtifact": "torchcls.artifacts.targets.base",
    "load_artifact": "torchcls.artifacts.artifact",
    "CompiledClassifier": "torchcls.artifacts.compiled_classifier",
    "compile_for_inference": "torchcls.artifacts.compiled_classifier",
    "ExportResult": "torchcls.artifacts.exporter",
    "export": "torchcls.artifacts.exporter",
}

__all__ = list(_API)

__getattr__ = lazy_api(globals(), _API)

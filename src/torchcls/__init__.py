"""torchcls: PyTorch-native image classification, from an eager prototype to verified production artifacts.

The public API is one function per command. They are imported lazily so that
`import torchcls` (and `torchcls --help`) does not pay for importing torch. No API name is
also the name of a sub-package: importing a sub-package sets it as an attribute of this
package, which would replace the function of the same name after first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from torchcls.noise import silence_known_noise

__version__ = "0.1.0"
silence_known_noise()  # library lines that read as errors on a successful run (torchcls.noise)

_API = {
    "train": "torchcls.training",
    "evaluate": "torchcls.evaluation",
    "predict": "torchcls.prediction",
    "export": "torchcls.artifacts",
    "load_artifact": "torchcls.artifacts",
    "demo": "torchcls.demo",
    "explain": "torchcls.explain",
    "Config": "torchcls.config",
}

__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'torchcls' has no attribute {name!r}")

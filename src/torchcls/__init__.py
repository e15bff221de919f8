"""torchcls: PyTorch-native image classification, from an eager prototype to verified production artifacts.

The public API is one function per command. They are imported lazily (torchcls.lazy) so that
`import torchcls` (and `torchcls --help`) does not pay for importing torch.
"""

from __future__ import annotations

from torchcls import consumers
from torchcls.lazy import lazy_api
from torchcls.noise import silence_known_noise
from torchcls.version import __version__

silence_known_noise()  # library lines that read as errors on a successful run (torchcls.noise)
consumers.connect()  # governance and the report hear the trainer and the exporter (torchcls.events)

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

__getattr__ = lazy_api(globals(), _API)

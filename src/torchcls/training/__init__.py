"""Training: the trainer, optimizer, parallelism (DDP/FSDP2, rank-0 init), the process group and
the run dir; precision and checkpoints are applied from outside (torchcls.precision,
torchcls.checkpoint).

Light to import: submodules are loaded on first use (torchcls.training.rundir, which the report
reads, does not pull in the trainer).
"""

from __future__ import annotations

from torchcls.lazy import lazy_api

_API = {
    "train": "torchcls.training.build",
    "TrainResult": "torchcls.training.trainer",
}

__all__ = list(_API)

__getattr__ = lazy_api(globals(), _API)

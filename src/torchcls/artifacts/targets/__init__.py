"""The export targets, one registry: each is a suffix, an options check, a build plan and a loader
(see base.Target). The exporter runs the same steps for every one of them; `load_artifact` finds
the loader by suffix."""

from __future__ import annotations

from torchcls.artifacts.targets import aoti, executorch, onnx
from torchcls.artifacts.targets.base import Target
from torchcls.errors import UserError

TARGETS: dict[str, Target] = {t.name: t for t in (aoti.TARGET, onnx.TARGET, executorch.TARGET)}
BY_SUFFIX: dict[str, Target] = {t.suffix: t for t in TARGETS.values()}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise UserError(f"--target {name}: choose one of {', '.join(TARGETS)}")
    return TARGETS[name]

"""AOTInductor target: a `.pt2` package of compiled code and frozen weights (needs torch, not the
model code). Metadata: the package's `aot_inductor.metadata`, key `torchcls` = the ArtifactInfo JSON,
plus flat `torchcls.*` keys that the C++ runner (cpp/) reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from torchcls.artifacts.targets.base import (
    META_KEY,
    ArtifactInfo,
    ExportRequest,
    LoadedArtifact,
    Plan,
    Target,
    checked_info,
    first_line,
    has_cond,
)
from torchcls.errors import UserError


class AOTIArtifact(LoadedArtifact):
    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            self.runner = torch._inductor.aoti_load_package(str(path))
        except Exception as e:  # the loader raises RuntimeError or zipfile errors on foreign or broken files
            raise UserError(f"{path} is not a loadable AOTInductor package ({first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target aoti`") from None
        meta = self.runner.get_metadata()
        if META_KEY not in meta:
            raise UserError(f"{path} is an AOTInductor package without torchcls metadata (class names, "
                            "preprocessing); export it with `torchcls export --target aoti`")
        self.info = checked_info(meta[META_KEY], path, "aoti")

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.runner(x)  # the model's output structure: one tensor, or (logits, exits)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)


@contextlib.contextmanager
def cond_safe_inductor(ep: torch.export.ExportedProgram) -> Iterator[None]:
    """Inductor's layout optimization turns convolutions channels-last; inside torch.cond branches that
    gave stride assertions or silently wrong outputs on one branch, so it is off for cond programs."""
    import torch._inductor.config as inductor_config

    old = inductor_config.layout_optimization
    inductor_config.layout_optimization = old and not has_cond(ep)
    try:
        yield
    finally:
        inductor_config.layout_optimization = old


def build(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, extra: dict[str, str]) -> dict[str, Any]:
    """AOTInductor package with frozen weights (constants folded, conv weights prepacked)."""
    metadata = {META_KEY: info.to_json(**extra), **info.flat_metadata()}
    configs = {"freezing": True, "aot_inductor.metadata": metadata}
    with cond_safe_inductor(ep), torch.no_grad():
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)
    return {}


def check(req: ExportRequest) -> None:
    if req.early_exit and req.precision != "fp32":
        raise UserError(f"--precision {req.precision}: early-exit models export in fp32 only")


def plan(req: ExportRequest, meta: Any) -> Plan:
    return Plan(req.precision, build)


TARGET = Target("aoti", ".pt2", AOTIArtifact, check, plan)

"""What `--model` and `--pretrained` accept: torchcls's own nets, early-exit forms, timm's registry
and torchvision's classifiers, and (with pretrained=True) timm's pretrained tags with the hub
repository of each and whether its weights are in the local cache already.

A pattern without wildcards matches anywhere in the name (`convnext` finds convnext_tiny); with
wildcards it is an fnmatch pattern (`resnet1*`). Case is ignored.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass
from typing import Any

from torchcls.models.early_exit import PREFIX as EARLY_EXIT_PREFIX
from torchcls.models.hub import HUB_PREFIX, in_cache
from torchcls.models.registry import TORCHVISION_PREFIX

OWN = ("smallnet", "fastnet", "fastnet_slim", "fastnet_lite")


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what --model takes
    family: str  # torchcls, early-exit, timm, torchvision
    pretrained: str | None = None  # --pretrained form of its weights (hf-hub:ORG/NAME), pretrained listings only
    cached: bool = False  # those weights are in the local hub cache (usable offline)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_models(pattern: str | None = None, pretrained: bool = False) -> list[ModelEntry]:
    """Every name `--model` accepts that matches `pattern`; with `pretrained`, timm's names with a
    pretrained tag instead (what `--model NAME.TAG --pretrained` loads from the hub)."""
    import timm

    if pretrained:
        return [_tagged(name) for name in timm.list_models(pretrained=True) if _matches(name, pattern)]
    import torchvision

    resnets = timm.list_models(module="resnet")  # the timm family early-exit models cut (models/early_exit.py)
    names = ([(n, "torchcls") for n in OWN]
             + [(EARLY_EXIT_PREFIX + n, "early-exit") for n in ("smallnet", *resnets)]
             + [(n, "timm") for n in timm.list_models()]
             + [(TORCHVISION_PREFIX + n, "torchvision")
                for n in sorted(torchvision.models.list_models(module=torchvision.models))])
    return [ModelEntry(name, family) for name, family in names if _matches(name, pattern)]


def _tagged(name: str) -> ModelEntry:
    from timm.models import get_pretrained_cfg

    hub_id = get_pretrained_cfg(name).hf_hub_id
    return ModelEntry(name, "timm", HUB_PREFIX + hub_id if hub_id else None, bool(hub_id) and in_cache(hub_id))


def _matches(name: str, pattern: str | None) -> bool:
    if not pattern:
        return True
    name, pattern = name.lower(), pattern.lower()
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name

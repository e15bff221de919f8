"""The hook API: code that every sample or output must pass through on a governed run.

Four stages, each a plain function registered under a name (policies require hooks by name):

- "file":   (PIL.Image, SampleInfo) -> PIL.Image. Runs when a file-backed data set is copied into
            the run's isolated processing directory; the model's loader reads only those copies.
- "tensor": (uint8 CxHxW tensor, SampleInfo) -> tensor. Runs in the per-sample load path, before
            transforms, so before any tensor reaches the model (also for built-in in-memory sets).
- "output": (OutputItem) -> OutputItem | None. Runs on every sample image or sample file name a
            run would write to its report, TensorBoard or files; None withholds the item.
- "model":  (nn.Module) -> nn.Module. Runs once on the model before training.

User hooks: decorate a function with `@hook("blur-faces", "file")` in an importable module and
pass `--hooks strip-exif,mypkg.faces:blur_faces`; the policy then names "blur-faces".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torchcls.errors import UserError

STAGES = ("file", "tensor", "output", "model")


@dataclass(frozen=True)
class SampleInfo:
    index: int  # index in the ImageSet
    id: str  # the manifest record's @id (a relative path, or split/index for built-in sets)
    sha256: str | None
    tags: frozenset[str] = frozenset()
    jurisdiction: str | None = None
    restricted: bool = False  # may this sample leave the run (reports, logs)?


@dataclass(frozen=True)
class OutputItem:
    kind: str  # "sample_image" (value: uint8 CxHxW tensor) or "file_name" (value: str)
    sample: SampleInfo
    value: Any
    redacted: bool = False


@dataclass(frozen=True)
class Hook:
    name: str
    stage: str
    fn: Callable = field(compare=False)


REGISTRY: dict[str, Hook] = {}


def hook(name: str, stage: str) -> Callable[[Callable], Callable]:
    """Register `fn` as hook `name` for `stage`; returns fn unchanged (with `.torchcls_hook` set)."""
    if stage not in STAGES:
        raise ValueError(f"hook stage must be one of {STAGES}, got {stage!r}")

    def register(fn: Callable) -> Callable:
        REGISTRY[name] = Hook(name, stage, fn)
        fn.torchcls_hook = REGISTRY[name]
        return fn

    return register


def resolve_hooks(spec: str | None) -> list[Hook]:
    """'strip-exif,redact-samples,pkg.mod:fn' -> hooks, in that order."""
    import torchcls.governance.builtin_hooks  # noqa: F401  (registers the built-in hooks)

    hooks = []
    for entry in (e.strip() for e in (spec or "").split(",")):
        if not entry:
            continue
        if ":" in entry:
            module, _, attr = entry.partition(":")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise UserError(f"--hooks: cannot import {entry!r} ({e})") from None
            if not hasattr(fn, "torchcls_hook"):
                raise UserError(f"--hooks: {entry} is not a hook; decorate it with "
                                "@torchcls.governance.hook(name, stage)")
            hooks.append(fn.torchcls_hook)
        elif entry in REGISTRY:
            hooks.append(REGISTRY[entry])
        else:
            raise UserError(f"--hooks: unknown hook {entry!r}; built-in: {', '.join(sorted(REGISTRY))}, "
                            "or module:function for your own")
    return hooks


def by_stage(hooks: list[Hook], stage: str) -> list[Hook]:
    return [h for h in hooks if h.stage == stage]


def run_output_hooks(hooks: list[Hook], item: OutputItem) -> OutputItem | None:
    """Pass `item` through the output hooks; a restricted sample that no hook redacted is withheld,
    so a missing or faulty hook fails closed."""
    for h in by_stage(hooks, "output"):
        item = h.fn(item)
        if item is None:
            return None
    if item.sample.restricted and not item.redacted:
        return None
    return item


def redacted(item: OutputItem, value: Any) -> OutputItem:
    return replace(item, value=value, redacted=True)

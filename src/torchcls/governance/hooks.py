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

Built-in hooks (registered at the end of this module): strip-exif (file stage) and redact-samples
(output stage).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torchcls.errors import UserError

if TYPE_CHECKING:
    from PIL import Image

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


class HookedImages:
    """An ImageSet whose `load` passes every sample through the tensor hooks (picklable for workers)."""

    def __init__(self, base, hooks: list[Hook], infos: list[SampleInfo]):
        self.base, self.hooks, self.infos = base, hooks, infos

    def load(self, i: int):
        x = self.base.load(i)
        for h in self.hooks:
            x = h.fn(x, self.infos[i])
        return x

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str):
        if name in ("base", "hooks", "infos"):  # not yet set while unpickling
            raise AttributeError(name)
        return getattr(self.base, name)


# --- built-in hooks ------------------------------------------------------------------------------


@hook("strip-exif", "file")
def strip_exif(im: Image.Image, info: SampleInfo) -> Image.Image:
    """A copy with only the pixels: EXIF (GPS, camera, time), XMP, ICC and text chunks are dropped.

    The EXIF orientation is applied first, so the model sees the same upright image as without
    the hook; the copy is rebuilt from raw pixels, so no metadata can ride along.
    """
    from PIL import Image, ImageOps

    im = ImageOps.exif_transpose(im)
    clean = Image.frombytes(im.mode, im.size, im.tobytes())
    if im.mode == "P":
        clean.putpalette(im.getpalette())
        if "transparency" in im.info:  # part of the pixels' meaning, not metadata
            clean.info["transparency"] = im.info["transparency"]
    return clean


@hook("redact-samples", "output")
def redact_samples(item: OutputItem) -> OutputItem:
    """Restricted samples: images become a flat grey tile, file names become a hash prefix."""
    if not item.sample.restricted:
        return item
    if item.kind == "sample_image":
        import torch

        return redacted(item, torch.full_like(item.value, 128))
    tag = item.sample.sha256[:16] if item.sample.sha256 else f"#{item.sample.index}"
    return redacted(item, f"[redacted sample sha256:{tag}]")

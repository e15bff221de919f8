"""The hook API: code that every sample or output must pass through on a governed run.

Four stages, each a plain function registered under a name (policies require hooks by name):

- "file":   (PIL.Image, SampleInfo) -> PIL.Image. Runs when a file-backed data set is copied into
            the run's isolated processing directory; the model's loader reads only those copies.
- "tensor": (uint8 CxHxW tensor, SampleInfo) -> tensor. Runs in the per-sample load path, before
            transforms, so before any tensor reaches the model (also for built-in in-memory sets).
- "output": (OutputItem) -> OutputItem | None. Runs on every sample image or sample file name a
            run would write to its report, TensorBoard or files; None withholds the item.
- "model":  (nn.Module) -> nn.Module. Runs once on the model before training.

Hooks are chosen by registered NAME only (`--hooks strip-exif,blur-faces`, `[governance] hooks`):
an option or a file (config, policy, run dir) never names a module or a function to import, so a
received run dir cannot make torchcls run its code. A name is one of:

- a built-in: strip-exif (file stage) and redact-samples (output stage), registered at the end of
  this module; no other code may take their names;
- a hook the caller's own Python registered before training, with `@hook("blur-faces", "file")` or
  `register_hook(...)` (the API: `torchcls.train(cfg)` after defining it);
- an entry point of an installed package in the group "torchcls.hooks", whose name is the hook's
  name (pyproject.toml: `[project.entry-points."torchcls.hooks"]  blur-faces = "mypkg.faces:blur_faces"`).
  Only the entry point asked for is loaded, after every name given was found, and it must be the
  function registered under that very name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torchcls.errors import UserError
from torchcls.provenance.records import MAX_RUN_HOOKS

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from PIL import Image

STAGES = ("file", "tensor", "output", "model")
ENTRY_POINT_GROUP = "torchcls.hooks"
BUILTIN = ("strip-exif", "redact-samples")
# A hook name is a plain word: no '.', ':' or '/', so no name can be read as a module path.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_OPTION = "--hooks ([governance] hooks)"


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


def register_hook(name: str, stage: str, fn: Callable) -> Hook:
    """Register `fn` as hook `name` for `stage` (sets `fn.torchcls_hook`); returns the Hook.

    A name is taken once: registering it again for another function is an error (a package must not
    silently replace a hook that a policy requires), except for the same function defined again
    (a module or notebook cell run twice). The built-ins' names belong to them."""
    if stage not in STAGES:
        raise ValueError(f"hook stage must be one of {STAGES}, got {stage!r}")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"hook name must be letters, digits, '-' and '_' (at most 64), got {name!r}")
    old = REGISTRY.get(name)
    if old is not None and old.fn is fn and old.stage == stage:
        return old
    if old is not None and old.fn is not fn and (name in BUILTIN or _where(old.fn) != _where(fn)):
        raise ValueError(f"hook name {name!r} is already registered by {_where(old.fn)}; choose another name")
    REGISTRY[name] = Hook(name, stage, fn)
    fn.torchcls_hook = REGISTRY[name]
    return REGISTRY[name]


def hook(name: str, stage: str) -> Callable[[Callable], Callable]:
    """Decorator: register the function as hook `name` for `stage`; returns it unchanged."""

    def register(fn: Callable) -> Callable:
        register_hook(name, stage, fn)
        return fn

    return register


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def resolve_hooks(spec: str | None) -> list[Hook]:
    """'strip-exif,redact-samples,blur-faces' -> hooks, in that order.

    Every name is checked before any code is loaded: its form, then that it is registered or
    declared by an installed package's entry point (metadata only); only then are the entry
    points of the names asked for loaded, each checked to be the hook registered under its name."""
    names = [e.strip() for e in (spec or "").split(",") if e.strip()]
    if len(names) > MAX_RUN_HOOKS:  # (before training: the run's audit record, which lists them, would be refused)
        raise UserError(f"{_OPTION}: {len(names):,} hooks; a run records at most {MAX_RUN_HOOKS} "
                        "(provenance/records.MAX_RUN_HOOKS)")
    for name in names:
        _check_form(name)
    found = {name: _entry_point(name) for name in names if name not in REGISTRY}
    unknown = [name for name, ep in found.items() if ep is None]
    if unknown:
        raise UserError(f"{_OPTION}: unknown hook{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; available: "
                        f"{', '.join(available_hooks()) or 'none'}. A hook is published by an installed "
                        f"package's entry point (group {ENTRY_POINT_GROUP!r}) or registered by your own Python "
                        "with @torchcls.governance.hook(name, stage) before training")
    for name, ep in found.items():
        _load_entry_point(name, ep)
    return [REGISTRY[name] for name in names]


def available_hooks() -> list[str]:
    """The names a run may choose: registered ones and installed entry points (nothing is loaded)."""
    from importlib.metadata import entry_points

    return sorted(set(REGISTRY) | set(entry_points(group=ENTRY_POINT_GROUP).names))


def _check_form(name: str) -> None:
    if ":" in name or "." in name:
        raise UserError(
            f"{_OPTION}: {name!r} names code to import (module:function); torchcls no longer imports code named "
            "by an option or a file, so hooks are chosen by registered name. Publish yours as an entry point of "
            f'an installed package (pyproject.toml: [project.entry-points."{ENTRY_POINT_GROUP}"] '
            'blur-faces = "mypkg.faces:blur_faces", then --hooks blur-faces), or register it from your own '
            'Python with @torchcls.governance.hook("blur-faces", "file") before calling torchcls.train(cfg)')
    if not NAME.fullmatch(name):
        raise UserError(f"{_OPTION}: {name!r} is not a hook name (letters, digits, '-' and '_', at most 64)")


def _entry_point(name: str) -> EntryPoint | None:
    """The installed entry point named `name` (read from package metadata; nothing is imported)."""
    from importlib.metadata import entry_points

    eps = list(entry_points(group=ENTRY_POINT_GROUP, name=name))
    if len(eps) > 1:
        raise UserError(f"{_OPTION}: hook {name!r} is declared by several installed packages "
                        f"({', '.join(_origin(ep) for ep in eps)}); uninstall all but one")
    return eps[0] if eps else None


def _load_entry_point(name: str, ep: EntryPoint) -> None:
    """Import the one entry point asked for; it must be the function registered as `name`."""
    try:
        obj = ep.load()
    except Exception as e:  # the installed package's import error is its own: say which one
        raise UserError(f"{_OPTION}: hook {name!r} ({_origin(ep)}) failed to load: {type(e).__name__}: {e}") from None
    h = getattr(obj, "torchcls_hook", None)
    if not isinstance(h, Hook) or h.fn is not obj or REGISTRY.get(name) is not h:
        what = f"is registered as {h.name!r}" if isinstance(h, Hook) else "is not a registered hook"
        raise UserError(f"{_OPTION}: entry point {name!r} ({_origin(ep)}) {what}; its target must be a function "
                        f"decorated with @torchcls.governance.hook({name!r}, stage)")


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} from {dist.name} {dist.version}" if dist is not None else ep.value


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

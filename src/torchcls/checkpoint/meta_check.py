"""The checkpoint metadata (`CheckpointMeta`'s JSON) as read from a file: every field checked against
a stated bound before anything uses it.

The metadata says what to build: a `num_classes` of 8,000,000 once made `load_model` and `consolidate`
allocate 2.7 GB for a classifier before the weights were compared with it. Here the JSON text is
bounded before it is parsed (bounded_json.py), then each field is checked for its type and
range: the model spec (models/registry.py's MAX_* bounds), one class name per class, the
preprocessing (a crop ratio divides the input side, so it is bounded too), one threshold per label.
`meta_fields` returns the fields typed, ready for CheckpointMeta; anything else is a UserError naming
the file and the field.
"""

from __future__ import annotations

from typing import Any

from torchcls.bounded_json import JsonBounds, load_bounded
from torchcls.data.preprocess import INTERPOLATIONS, Preprocess, check_input, int_in, number_in
from torchcls.errors import UserError
from torchcls.models.registry import MAX_CLASSES, spec_from_dict
from torchcls.tasks import MULTICLASS, MULTILABEL

# The metadata's JSON: 8 MiB, the bound on a whole safetensors header (safetensors_bounds.py), holds
# MAX_CLASSES class names of ~60 characters with their thresholds (ImageNet-21k's 21,841 take ~0.3 MiB);
# the config it carries nests 3 levels (section, option, list value); paths are under 4096 characters.
META_BOUNDS = JsonBounds(max_bytes=8 * 2**20, max_values=4 * MAX_CLASSES + 100_000, max_depth=8, max_str=4096)
MAX_CLASS_NAME = 1024  # characters of one class name (a folder name is at most 255 bytes on most file systems)
MAX_COUNTER = 10**12  # epochs and optimizer steps


def meta_fields(text: str | bytes, where: str) -> dict[str, Any]:
    """CheckpointMeta's fields from its JSON `text` (read from `where`), each checked against its bound."""
    if isinstance(text, str):  # (a lone surrogate cannot be UTF-8: it becomes bytes the parser refuses)
        text = text.encode("utf-8", "surrogatepass")
    raw = load_bounded(text, META_BOUNDS, f"{where}: checkpoint metadata")
    if not isinstance(raw, dict):
        raise UserError(f"{where}: the checkpoint metadata must be a JSON object")
    missing = [k for k in ("spec", "classes", "preprocess", "config", "epoch", "step") if k not in raw]
    if missing:
        raise UserError(f"{where}: the checkpoint metadata lacks {', '.join(missing)}: it was not written by "
                        "`torchcls train`")
    spec = spec_from_dict(raw["spec"], f"{where}: checkpoint metadata")
    return {"spec": spec, "classes": check_classes(raw["classes"], spec.num_classes, where),
            "preprocess": check_preprocess(raw["preprocess"], spec.in_chans, where),
            "config": _config(raw["config"], where),
            "epoch": _counter(raw["epoch"], "epoch", where), "step": _counter(raw["step"], "step", where),
            "thresholds": check_thresholds(raw.get("thresholds"), spec.num_classes, where)}


def check_classes(value: Any, num_classes: int | None, where: str) -> list[str]:
    """One class name (a bounded string) per class; `num_classes` None: any count up to MAX_CLASSES."""
    expected = num_classes if num_classes is not None else len(value) if isinstance(value, list) else -1
    if not isinstance(value, list) or len(value) != expected or not 1 <= expected <= MAX_CLASSES:
        raise UserError(f"{where}: the metadata must list one class name for each of its "
                        f"{num_classes or f'1 to {MAX_CLASSES:,}'} classes")
    if not all(isinstance(name, str) and len(name) <= MAX_CLASS_NAME for name in value):
        raise UserError(f"{where}: every class name must be a string of at most {MAX_CLASS_NAME} characters")
    return value


def check_preprocess(value: Any, in_chans: int | None, where: str) -> Preprocess:
    """The preprocessing, each value in its range (data/preprocess.check_input, the bounds a pretrained config
    is held to as well); `in_chans` None: any channel count up to MAX_IN_CHANS."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: the checkpoint's preprocess must be a JSON object")
    value = {"interpolation": "bilinear", "crop_pct": 1.0} | value  # older checkpoints lack these two
    check_input(value, in_chans, f"{where}: preprocess")
    if value["interpolation"] not in INTERPOLATIONS:
        raise UserError(f"{where}: preprocess interpolation must be one of {', '.join(INTERPOLATIONS)}")
    return Preprocess.from_dict(value)


def _config(value: Any, where: str) -> dict[str, Any]:
    """The training config: free-form within META_BOUNDS, but its [data] task is one torchcls knows."""
    if not isinstance(value, dict) or not isinstance(value.get("data", {}), dict):
        raise UserError(f"{where}: the checkpoint's config must be a JSON object of sections")
    if value.get("data", {}).get("task", MULTICLASS) not in (MULTICLASS, MULTILABEL):
        raise UserError(f"{where}: the checkpoint's task must be {MULTICLASS} or {MULTILABEL}")
    return value


def _counter(value: Any, name: str, where: str) -> int:
    if not int_in(value, 0, MAX_COUNTER):
        raise UserError(f"{where}: the checkpoint's {name} must be an integer in [0, {MAX_COUNTER:,}]")
    return value


def check_thresholds(value: Any, num_classes: int, where: str) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != num_classes or not all(number_in(t, 0, 1) for t in value):
        raise UserError(f"{where}: the thresholds must be {num_classes} numbers in [0, 1], one a label")
    return [float(t) for t in value]


"""Does a weights file fit the model its metadata names? Answered before the model is built.

The metadata names an architecture and its sizes (a bounded ModelSpec, checkpoint/meta_check.py);
the weights file's header states each tensor's shape, and safetensors refuses a header whose
tensors the file's bytes do not cover. `fitted_model` first builds the model on the meta device
(shapes, no storage), compares its state dict with the header's shapes, and only when every name
and shape agrees builds it on the CPU: what is then allocated is what the file itself holds. A
model that cannot be built on the meta device (torchvision's RegNets compute their widths with
tensors) is held to the classifier check instead: a 2-D tensor of num_classes rows must be in the
file, and the file's total element count under MAX_PARAMETERS; its CPU build then costs what the
registry's architecture costs at a bounded num_classes, never what a number in the file asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from torchcls.checkpoint.safetensors_bounds import DEFAULT_BOUNDS, METADATA, bounded_numel, check_safetensors_header
from torchcls.errors import UserError
from torchcls.models.registry import ModelSpec, check_spec, create_model

MAX_PARAMETERS = 2_000_000_000  # elements in one weights file: 8 GB in fp32; timm's largest models have ~1.8B

Shapes = Mapping[str, tuple[int, ...]]


def read_header(path: str | Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """A safetensors file's metadata and each tensor's shape, from its header alone, checked under
    safetensors_bounds.DEFAULT_BOUNDS (a regular file; header size, tensor count, ranks, dims, byte
    ranges) before any library parses it. A path a user names may be a link to the file."""
    try:
        header = check_safetensors_header(path, follow_symlinks=True)
    except UserError as e:
        raise UserError(f"{path} is not a safetensors checkpoint torchcls can read ({e}); torchcls reads only "
                        ".safetensors weights written by `torchcls train`") from None
    shapes = {name: tuple(entry["shape"]) for name, entry in header.items() if name != METADATA}
    return header.get(METADATA, {}), shapes


def check_sizes(shapes: Shapes, where: str | Path) -> None:
    """Refuse tensors of more dims than safetensors_bounds allows, or more elements in all than MAX_PARAMETERS."""
    total = 0
    for name, shape in shapes.items():
        if len(shape) > DEFAULT_BOUNDS.max_ndim:
            raise UserError(f"checkpoint {where}: tensor {name[:100]} has {len(shape)} dims, over the bound of "
                            f"{DEFAULT_BOUNDS.max_ndim}")
        numel = bounded_numel(list(shape), MAX_PARAMETERS - total)
        if numel is None:
            raise UserError(f"checkpoint {where} holds more than {MAX_PARAMETERS:,} elements (MAX_PARAMETERS)")
        total += numel


def fit_problems(expected: Shapes, have: Shapes) -> str | None:
    """What keeps tensors of shapes `have` from loading into a state dict of shapes `expected`, or None."""
    missing = sorted(set(expected) - set(have))
    unexpected = sorted(set(have) - set(expected))
    mismatched = [k for k in expected if k in have and tuple(expected[k]) != tuple(have[k])]
    if not (missing or unexpected or mismatched):
        return None
    return "; ".join(part for part in (
        f"missing {len(missing)} (e.g. {missing[0]})" if missing else "",
        f"unexpected {len(unexpected)} (e.g. {unexpected[0][:100]})" if unexpected else "",
        f"shape mismatch in {mismatched[0]}: {tuple(have[mismatched[0]])} vs "
        f"{tuple(expected[mismatched[0]])}" if mismatched else "") if part)


def misfit(where: str | Path, detail: str) -> UserError:
    return UserError(f"checkpoint {where} does not fit the model ({detail}); was it trained with another "
                     "--model, number of classes or --channels?")


def fitted_model(spec: ModelSpec, shapes: Shapes, where: str | Path) -> nn.Module:
    """The model `spec` describes, built on the CPU only once tensors of `shapes` are known to fit it."""
    check_spec(spec, f"checkpoint {where}")
    check_sizes(shapes, where)
    expected = meta_shapes(spec)
    if expected is not None:
        detail = fit_problems(expected, shapes)
        if detail:
            raise misfit(where, detail)
    elif not any(len(s) == 2 and s[0] == spec.num_classes for s in shapes.values()):
        raise misfit(where, f"no classifier weight of {spec.num_classes} rows")
    return create_model(spec)


def meta_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]] | None:
    """The state dict's shapes of the model `spec` describes, built on the meta device (no storage);
    None for a model that cannot be built there."""
    try:
        with torch.device("meta"):
            model = create_model(spec)
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - its constructor computes with tensor values (.item(), .tolist())
        return None
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}

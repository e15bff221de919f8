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

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from torchcls.errors import UserError
from torchcls.io_files import regular_path
from torchcls.models.registry import ModelSpec, check_spec, create_model

MAX_TENSORS = 100_000  # tensors in one weights file (a ViT-g has ~600 with its optimizer-free state)
MAX_RANK = 8  # dims of one tensor (convolution weights have 4, 3-D ones 5)
MAX_PARAMETERS = 2_000_000_000  # elements in one weights file: 8 GB in fp32; timm's largest models have ~1.8B

Shapes = Mapping[str, tuple[int, ...]]


def header_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors file's header; no tensor is read. The file must be a
    regular one (checked on the open file) and its header within MAX_TENSORS and MAX_RANK."""
    from safetensors import SafetensorError, safe_open

    try:
        with regular_path(path, what="checkpoint") as p, safe_open(p, framework="pt") as f:
            names = f.keys()
            if len(names) > MAX_TENSORS:
                raise UserError(f"checkpoint {path} holds {len(names):,} tensors, over the bound of {MAX_TENSORS:,}")
            return {name: tuple(f.get_slice(name).get_shape()) for name in names}
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} is not a safetensors checkpoint ({e}); torchcls reads only .safetensors "
                        "weights written by `torchcls train`") from None


def check_sizes(shapes: Shapes, where: str | Path) -> None:
    """Refuse tensors of too many dims, or more elements in all than MAX_PARAMETERS."""
    total = 0
    for name, shape in shapes.items():
        if len(shape) > MAX_RANK:
            raise UserError(f"checkpoint {where}: tensor {name[:100]} has {len(shape)} dims, over the bound of "
                            f"{MAX_RANK}")
        total += math.prod(shape)  # at most MAX_RANK factors each
        if total > MAX_PARAMETERS:
            raise UserError(f"checkpoint {where} holds more than {MAX_PARAMETERS:,} elements (MAX_PARAMETERS)")


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

"""Which custom ops a model's exported graph calls (torch.export; node.target an OpOverload)."""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.errors import UserError
from torchcls.kernel_audit.ops import BUILTIN_NAMESPACES


def load_audit_model(target: str, img_size: int | None = None, batch: int = 2) -> tuple[nn.Module, torch.Tensor, str]:
    """A model and an example input (`batch` images) from a checkpoint / run dir, a `package.module:factory`
    callable (returns a module, or (module, example_input)), or a model name (random init).

    `target` is code the user names on the command line (`audit kernels --model`, `bench compile --models`)
    or passes to the API, never a value read from a file: a checkpoint or run dir given here is loaded as
    data (its meta.json names an architecture, built from the model registry, never a module)."""
    if ":" in target and not Path(target).exists():
        module_name, attr = target.split(":", 1)
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise UserError(f"--model {target}: cannot load {attr} from {module_name} ({e})") from None
        made = factory()
        model, x = made if isinstance(made, tuple) else (made, torch.randn(1, 3, img_size or 224, img_size or 224))
        return model.eval(), x[:1].repeat(batch, *[1] * (x.dim() - 1)), "factory"
    if Path(target).exists() or target.endswith(".safetensors"):
        from torchcls.checkpoint.files import load_model

        model, meta = load_model(target)
        size = img_size or meta.preprocess.img_size
        return model, torch.randn(batch, meta.preprocess.channels, size, size), "checkpoint"
    from torchcls.models import ModelSpec, create_model

    small = target == "smallnet"
    spec = ModelSpec(target, 10 if small else 1000, 3, img_size or (28 if small else 224))
    return create_model(spec).eval(), torch.randn(batch, 3, spec.img_size, spec.img_size), "model name"


def ops_in_graph(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Export the model and count calls per custom op; an export failure is a result, not a crash."""
    try:
        with torch.no_grad():
            ep = torch.export.export(model, (x,))
    except Exception as e:
        return {"exported": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}", "custom_ops": {}}
    calls: Counter[str] = Counter()
    total = 0
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        total += 1
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace not in BUILTIN_NAMESPACES:
            calls[target.name()] += 1
    return {"exported": True, "error": None, "graph_calls": total, "custom_ops": dict(sorted(calls.items()))}

"""Sample inputs for custom ops, so `torchcls audit kernels` can run `torch.library.opcheck` on them.

Op authors register examples next to their op, in either of two ways:

    from torchcls.audit import register_example
    register_example("mylib::scale", lambda: ((torch.randn(4, 8, requires_grad=True), 2.0), {}))

or, without depending on torchcls, a module-level dict in the imported package:

    TORCHCLS_OP_EXAMPLES = {"mylib::scale": lambda: ((torch.randn(4, 8), 2.0), {})}

Each value is a zero-argument callable returning (args, kwargs); a list of them gives
several samples. Ops without a registered example get one built from their schema
(float tensors, 1.5 for floats, 1 for ints) when every argument is of a simple type.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

Sample = tuple[tuple[Any, ...], dict[str, Any]]
SampleFn = Callable[[], Sample]

_REGISTRY: dict[str, list[SampleFn]] = {}


def register_example(op_name: str, make: SampleFn) -> None:
    """Register sample inputs for the op `namespace::name` (its default overload)."""
    if "::" not in op_name:
        raise ValueError(f"op name must be 'namespace::name', got {op_name!r}")
    _REGISTRY.setdefault(op_name, []).append(make)


def examples_for(op_name: str) -> tuple[list[SampleFn], str]:
    """(sample makers, where they came from) for an op."""
    if op_name in _REGISTRY:
        return _REGISTRY[op_name], "registered"
    for mod in list(sys.modules.values()):
        table = getattr(mod, "TORCHCLS_OP_EXAMPLES", None) if mod is not None else None
        if isinstance(table, dict) and op_name in table:
            value = table[op_name]
            return (list(value) if isinstance(value, (list, tuple)) else [value]), f"{mod.__name__}.TORCHCLS_OP_EXAMPLES"
    # Made-up samples only for ops with Python kernels: C++ kernels reject them noisily (shape checks, stack dumps).
    schema_sample = _from_schema(op_name) if _python_kernels(op_name) else None
    return ([schema_sample], "generated from schema") if schema_sample else ([], "none")


def _python_kernels(op_name: str) -> bool:
    import torch

    dump = torch._C._dispatch_dump(op_name)
    return ".cpp:" not in dump and ".cu:" not in dump


def _from_schema(op_name: str) -> SampleFn | None:
    import torch

    ns, name = op_name.split("::", 1)
    try:
        schema = getattr(getattr(torch.ops, ns), name).default._schema
    except (AttributeError, RuntimeError):
        return None
    makers = {"Tensor": lambda: torch.randn(2, 3, requires_grad=True), "float": lambda: 1.5,
              "int": lambda: 1, "bool": lambda: False}
    arg_types = [str(a.type) for a in schema.arguments if not (a.has_default_value() or a.kwarg_only)]
    if not all(t in makers for t in arg_types):
        return None
    return lambda: (tuple(makers[t]() for t in arg_types), {})

"""Sizes an ONNX graph computes from dims of its values, traced to where each element came from.

A transformer's export reshapes with targets read off its own values (`x.reshape(-1, *x.shape[-2:])`
becomes Reshape(x, Concat([-1], Shape(x)[-2:]))), and a `torch.arange(B)` becomes Range(0, Shape(x)[0],
1). A Reshape's -1 *divides* by the other entries, so a target that takes dims of one value to reshape
another could shrink as the batch grows (and a size that shrinks somewhere is one the check at the largest
batch would not see). So a target made of dims is allowed only where it cannot: without -1 (every output
dim is a dim of some value or a constant), or with -1 and then only distinct dims of the very value it
reshapes (the -1 is then the product of that value's remaining dims, over constants). `trace` follows
each element through Shape and the operators that only rearrange dims, with the ranks shape inference
gave; anything it cannot follow is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Item = tuple  # ("const", value) | ("dim", value name, axis)
MAX_TRACE = 256  # operators followed back from one target


def trace(name: str, producers: dict[str, Any], ranks: dict[str, int], literal: Callable[[str], list | None],
          depth: int = 0) -> list[Item] | None:
    """The elements of the 1-D integer value `name`, each a constant or a dim of a value; None if unknown."""
    values = literal(name)
    if values is not None:
        return [("const", int(v)) for v in values]
    node = producers.get(name)
    if node is None or depth > MAX_TRACE:
        return None
    op, ins = node.op_type, list(node.input)

    def follow(i: int) -> list[Item] | None:
        return trace(ins[i], producers, ranks, literal, depth + 1) if i < len(ins) and ins[i] else None

    if op == "Shape":
        rank = ranks.get(ins[0])
        if rank is None:
            return None
        attrs = {a.name: a.i for a in node.attribute}
        return [("dim", ins[0], j) for j in range(rank)][slice(attrs.get("start", 0), attrs.get("end"))]
    if op in ("Squeeze", "Unsqueeze", "Identity", "Cast", "Reshape"):
        return follow(0)
    if op == "Concat":
        parts = [follow(i) for i in range(len(ins))]
        return None if any(p is None for p in parts) else [item for p in parts for item in p]
    if op == "Gather":
        data, index = follow(0), literal(ins[1]) if len(ins) > 1 else None
        if data is None or index is None or not all(-len(data) <= i < len(data) for i in index):
            return None
        return [data[int(i)] for i in index]
    if op == "Slice":
        data, params = follow(0), [literal(ins[i]) if i < len(ins) and ins[i] else None for i in range(1, 5)]
        if data is None or params[0] is None or params[1] is None or len(params[0]) != 1:
            return None
        step = params[3][0] if params[3] else 1
        return data[slice(int(params[0][0]), int(params[1][0]), int(step) or None)]
    return None


def reshape_problem(node: Any, target: list[Item] | None) -> str | None:
    """Why a Reshape whose target is made of dims could shrink as the batch grows; None if it cannot."""
    if target is None:
        return "its target is computed in a way that cannot be traced to dims and constants"
    copy = not any(a.name == "allowzero" and a.i for a in node.attribute)  # a 0 copies the input's dim there
    items = [("dim", node.input[0], p) if copy and item == ("const", 0) else item for p, item in enumerate(target)]
    consts = [item[1] for item in items if item[0] == "const"]
    if any(v < -1 for v in consts) or consts.count(-1) > 1:
        return f"its target has the entries {consts}"
    dims = [item for item in items if item[0] == "dim"]
    if -1 in consts and (any(d[1] != node.input[0] for d in dims) or len({d[2] for d in dims}) != len(dims)):
        return "its -1 divides by dims that are not distinct dims of the value it reshapes"
    return None

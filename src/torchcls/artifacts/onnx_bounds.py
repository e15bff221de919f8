"""Bounded before built, for `.onnx` artifacts: everything an ONNX graph can make ONNX Runtime allocate is
read from the graph and checked against a stated bound before a session exists.

Creating a session folds the graph's constant subgraphs: a 191-byte file holding ConstantOfShape([2^28])
took 2.75 GB there, before any metadata was read. So the loader reads the file once (`read_model`, a
size bound), counts what parsing it would build before parsing it (`protobuf_scan`: an empty node is 2
bytes in a file and 150 once parsed, so a 7.6 MiB file took 614 MiB to parse), checks its metadata, then
`check_graph`:

1. Structure, by construction: one image input of the metadata's shape, the outputs an export writes,
   operators from `onnx_ops.ALLOWED` in the standard domain, no local functions, sparse or external
   tensors, ≤ MAX_NODES nodes, subgraphs nested ≤ MAX_DEPTH, every stored tensor's data as long as its
   dims say.
2. Sizes: every input that an operator reads as a size is a constant of the file (or dims of another
   value, where `onnx_ops` says that cannot shrink), so every value's shape grows with the batch.
3. Shapes: the declared shapes are dropped, the input is fixed to [max_batch, C, H, W] (and [1, C, H, W])
   and ONNX's shape inference (strict, with data propagation) must give every value of every graph a
   static shape of at most `value_bound(...)` elements; values that do not depend on the image (what
   the session folds) at most MAX_CONSTANT_ELEMENTS each and MAX_CONSTANT_TOTAL in all.

The session is then made from the very bytes that were checked (no second open).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchcls.artifacts import onnx_ops
from torchcls.artifacts.protobuf_scan import ScanError, scan
from torchcls.artifacts.sizes import value_bound
from torchcls.errors import UserError
from torchcls.io_files import read_bytes

MAX_ONNX_BYTES = 2**31 - 1  # protobuf's own limit for one message; torchcls exports embed their weights
MAX_NODES = 100_000  # counting nodes inside If branches (resnet50: ~120; a ViT-L: a few thousand)
MAX_DEPTH = 32  # nested subgraphs (an early-exit model nests one If per exit, at most 16)
MAX_RANK = 16
MAX_CONSTANT_ELEMENTS = 2**26  # one value computed from constants only: the session folds it when created
MAX_CONSTANT_TOTAL = 2**28  # all of them together
# What the protobuf parse may build, counted on the wire before it runs (an exported resnet50: 8,096 fields,
# 2,949 messages; mobilenetv3: 9,783 and 3,538). At most ~200 bytes a message and ~32 a field once parsed:
# ~350 MB at these bounds, whatever the file's size (it was ~80 times the file's size).
MAX_PROTOBUF_FIELDS = 2**22  # every field occurrence, each element of a packed varint field included
MAX_PROTOBUF_MESSAGES = 2**20
MAX_MESSAGE_DEPTH = 100  # protobuf's own parser stops there (subgraphs are 3 messages deeper than their graph)
_SMALL = 1024  # stored tensors of at most this many elements keep their data for shape inference
# Element types a value may have: numbers of at most 8 bytes and booleans (no strings, no complex).
_DTYPES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}


def read_model(path: Path) -> tuple[bytes, Any]:
    """The bytes of the regular file `path` (≤ MAX_ONNX_BYTES) and the ModelProto they hold."""
    import onnx
    from google.protobuf.message import DecodeError

    data = read_bytes(path, max_bytes=MAX_ONNX_BYTES, what="ONNX model")
    try:  # before the parse, which builds all it reads: counted on the wire, no allocation that grows with it
        scan(data, onnx.ModelProto.DESCRIPTOR, max_fields=MAX_PROTOBUF_FIELDS, max_messages=MAX_PROTOBUF_MESSAGES,
             max_depth=MAX_MESSAGE_DEPTH, limits={onnx.NodeProto.DESCRIPTOR.full_name: (MAX_NODES, "nodes")})
        return data, onnx.load_model_from_string(data)
    except ScanError as e:
        if not e.malformed:
            raise _Walk(path).refuse(str(e)) from None
        error: BaseException = e
    except (DecodeError, RecursionError, ValueError) as e:
        error = e
    raise UserError(f"{path} is not a loadable ONNX model ({error or type(error).__name__}); export one with "
                    "`torchcls export CHECKPOINT --target onnx`")


@dataclass
class _Walk:
    """What one pass over the graphs learns: per value, whether it depends on the image input."""

    path: Path
    kind: dict[str, str] = field(default_factory=dict)  # name -> "const" | "dims" | "image"
    literal: dict[str, Any] = field(default_factory=dict)  # name -> stored tensor (small constants)
    nodes: int = 0
    constant_total: int = 0  # elements of the distinct constant values seen so far
    reshapes: list[Any] = field(default_factory=list)  # Reshapes whose target is made of dims (onnx_dims)
    ranges: list[tuple[Any, Any]] = field(default_factory=list)  # (Range counting to a dim, its graph)

    def values(self, name: str) -> list | None:
        """The elements of a small stored constant, flattened; None for anything else."""
        from onnx import numpy_helper

        t = self.literal.get(name)
        return None if t is None else numpy_helper.to_array(t).reshape(-1).tolist()

    def refuse(self, what: str) -> UserError:
        return UserError(f"{self.path}: refusing this ONNX model before ONNX Runtime sees it: {what}. torchcls "
                         "exports never hold that; re-export it with `torchcls export --target onnx`")


def check_graph(model: Any, channels: int, size: int, max_batch: int, outputs: int, path: Path) -> None:
    """Refuse (UserError naming `path`) a model whose graph could allocate beyond the bounds above.
    `model` is changed in place (declared shapes dropped): give ONNX Runtime the bytes, not this model."""

    walk = _Walk(path)
    if model.functions or model.training_info:
        raise walk.refuse("it defines local functions or training graphs")
    if any(o.domain not in onnx_ops.DOMAINS or o.version < onnx_ops.MIN_OPSET for o in model.opset_import):
        raise walk.refuse(f"it imports operator sets {[(o.domain, o.version) for o in model.opset_import]} (an "
                          f"export imports the standard one, version {onnx_ops.MIN_OPSET} or later)")
    g = model.graph
    batch = _check_io(walk, g, channels, size, max_batch, outputs)
    _walk_graph(walk, g, depth=0)
    _prepare(g, outer_small={}, top=True)
    sizes = [batch] if batch else [max_batch, 1]
    constants: set[str] = set()
    for b in sizes:
        g.input[0].type.tensor_type.shape.dim[0].Clear()
        g.input[0].type.tensor_type.shape.dim[0].dim_value = b
        inferred = _infer(walk, model, b)
        _check_values(walk, inferred.graph, value_bound(b, channels, size), constants)
        if b == sizes[0]:
            _check_reshapes(walk, inferred.graph)


def _infer(walk: _Walk, model: Any, batch: int) -> Any:
    """ONNX shape inference of `model` (strict, with data propagation) at this batch. A Range counting to a
    dim is not something ONNX's inference follows: each such limit is traced to its dim, which the previous
    round inferred, and given as a constant for the next round (taken back out afterwards)."""
    import numpy as np
    from onnx import numpy_helper, shape_inference

    from torchcls.artifacts.onnx_dims import trace

    added: list[tuple[Any, Any, str]] = []
    try:
        for _ in range(len(walk.ranges) + 1):
            try:
                inferred = shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
            except Exception as e:  # InferenceError, ValidationError: the graph contradicts itself or the metadata
                raise walk.refuse(f"shape inference at a batch of {batch} fails ({str(e).strip()[:300]})") from None
            producers, shapes = _facts(inferred.graph)
            ranks = {name: len(dims) for name, dims in shapes.items()}
            resolved = False
            for node, graph in walk.ranges:
                items = trace(node.input[1], producers, ranks, walk.values) if not node.input[1].endswith("@") else []
                limit = items[0] if items and len(items) == 1 else ("unknown",)
                value = limit[1] if limit[0] == "const" else (shapes.get(limit[1]) or {}).get(limit[2]) \
                    if limit[0] == "dim" else None
                if isinstance(value, int):
                    graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), node.input[1] + "@"))
                    added.append((node, graph, node.input[1]))
                    node.input[1] += "@"
                    resolved = True
            if not resolved:
                return inferred
        return inferred
    finally:
        for node, graph, name in added:
            node.input[1] = name
            graph.initializer.remove(next(t for t in graph.initializer if t.name == name + "@"))


def _check_io(walk: _Walk, g: Any, channels: int, size: int, max_batch: int, outputs: int) -> int:
    """The one input must be float32 [N, C, H, W] with C, H, W those of the metadata and N a name or at most
    max_batch (returned; 0 for a name); as many outputs as an export writes."""
    if len(g.input) != 1 or len(g.output) != outputs:
        raise walk.refuse(f"it has {len(g.input)} inputs and {len(g.output)} outputs (an export has one input, "
                          f"the images, and {outputs} output{'s' * (outputs > 1)})")
    t = g.input[0].type
    dims = list(t.tensor_type.shape.dim) if t.HasField("tensor_type") else []
    if t.tensor_type.elem_type != 1 or len(dims) != 4:
        raise walk.refuse("its input is not a float32 tensor of rank 4 (images)")
    want = (channels, size, size)
    for d, w in zip(dims[1:], want):
        if d.HasField("dim_value") and d.dim_value != w:
            raise walk.refuse(f"its input is declared {[x.dim_value or x.dim_param for x in dims]}, its metadata "
                              f"says images of {want}")
        d.Clear()
        d.dim_value = w
    if dims[0].HasField("dim_value") and not 1 <= dims[0].dim_value <= max_batch:
        raise walk.refuse(f"its input is declared for batches of {dims[0].dim_value}, its metadata says at most "
                          f"{max_batch}")
    if g.input[0].name in {t.name for t in g.initializer}:
        raise walk.refuse("its input has a stored default value")
    walk.kind[g.input[0].name] = "image"
    return dims[0].dim_value if dims[0].HasField("dim_value") else 0


def _stored(walk: _Walk, t: Any) -> int:
    """Elements of a tensor stored in the file, refused unless its data is embedded and as long as its dims."""
    from onnx.helper import tensor_dtype_to_field

    if t.data_location != 0 or t.external_data:
        raise walk.refuse(f"tensor {t.name!r} keeps its data in another file")
    if t.data_type not in _DTYPES or len(t.dims) > MAX_RANK or any(d < 0 for d in t.dims):
        raise walk.refuse(f"tensor {t.name!r} has element type {t.data_type} or dims {list(t.dims)[:MAX_RANK]}")
    n = 1
    for d in t.dims:
        n *= d
        if n > MAX_ONNX_BYTES:
            break
    have = len(t.raw_data) // _DTYPES[t.data_type] if t.HasField("raw_data") else len(
        getattr(t, tensor_dtype_to_field(t.data_type)))
    if have != n:
        raise walk.refuse(f"tensor {t.name!r} says {list(t.dims)} but stores {have} elements")
    return n


def _walk_graph(walk: _Walk, g: Any, depth: int) -> None:
    """Check every node in order (the file's order is topological, as ONNX requires) and classify its outputs."""
    import onnx

    if depth > MAX_DEPTH:
        raise walk.refuse(f"its subgraphs nest deeper than {MAX_DEPTH}")
    if g.sparse_initializer:
        raise walk.refuse("it holds sparse tensors (they are made dense when a session is created)")
    for t in g.initializer:
        if _stored(walk, t) <= _SMALL:
            walk.literal[t.name] = t
        walk.kind[t.name] = "const"
    for node in g.node:
        walk.nodes += 1
        if walk.nodes > MAX_NODES:
            raise walk.refuse(f"it has more than {MAX_NODES} nodes")
        if node.domain not in onnx_ops.DOMAINS or node.op_type not in onnx_ops.ALLOWED:
            raise walk.refuse(f"operator {node.domain + '.' if node.domain else ''}{node.op_type} (node "
                              f"{node.name!r}) is not one whose output sizes can be bounded before it runs")
        kinds = [walk.kind.get(i, "") for i in node.input if i]
        for a in node.attribute:
            if a.type in (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS):
                raise walk.refuse(f"node {node.name!r} holds a sparse tensor")
            for t in [a.t] * (a.type == onnx.AttributeProto.TENSOR) + list(a.tensors):
                _stored(walk, t)
        for sub in _subgraphs(node):
            if sub.input:
                raise walk.refuse(f"a subgraph of node {node.name!r} takes inputs")
            _walk_graph(walk, sub, depth + 1)
            kinds += [walk.kind.get(o.name, "") for o in sub.output]
        if "" in kinds:
            raise walk.refuse(f"node {node.name!r} reads a value defined nowhere before it")
        _check_sizes(walk, node, g)
        kind = _output_kind(node, kinds)
        for o in node.output:
            walk.kind[o] = kind
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            walk.literal[node.output[0]] = node.attribute[0].t


def _output_kind(node: Any, kinds: list[str]) -> str:
    if all(k == "const" for k in kinds):
        return "const"
    if node.op_type in ("Shape", "Size"):
        return "dims"
    if node.op_type in onnx_ops.DIM_PLUMBING and all(k != "image" for k in kinds):
        return "dims"
    return "image"


def _check_sizes(walk: _Walk, node: Any, g: Any) -> None:
    """Every size input of `node` must be a constant (or dims, where that cannot shrink); a Slice of an
    image-dependent value must be one whose length grows with its input."""
    op = node.op_type
    for i in onnx_ops.SIZE_INPUTS.get(op, ()):
        if i >= len(node.input) or not node.input[i]:
            continue
        kind = walk.kind[node.input[i]]
        if kind == "image" or (kind == "dims" and (op, i) not in onnx_ops.DIMS_ALLOWED):
            raise walk.refuse(f"node {node.name!r} ({op}) takes its {onnx_ops.describe(op, i)} from the images, "
                              "a size no check before running it could bound")
    if op == "Reshape" and walk.kind[node.input[1]] == "dims":
        walk.reshapes.append(node)
    if op == "Range" and walk.kind[node.input[1]] == "dims":  # its length grows with the limit if delta > 0
        start, delta = _literal(walk, node, 0), _literal(walk, node, 2)
        if start is None or delta is None or len(delta) != 1 or not delta[0] > 0:
            raise walk.refuse(f"Range {node.name!r} counts to a dim of a value with a start or step that is "
                              "not a constant (a positive step)")
        walk.ranges.append((node, g))
    if op == "Slice" and walk.kind[node.input[0]] == "image":
        params = [_literal(walk, node, i) for i in range(1, 5)]
        starts, ends = params[0], params[1]
        steps = params[3] if params[3] is not None else [1] * len(starts)
        if len(ends) != len(starts) or len(steps) != len(starts) or not all(
                onnx_ops.slice_is_monotone(int(s), int(e), int(k)) for s, e, k in zip(starts, ends, steps)):
            raise walk.refuse(f"Slice {node.name!r} of an image-dependent value takes {list(starts)}:{list(ends)}:"
                              f"{list(steps)}, a length that can shrink as the batch grows")


def _literal(walk: _Walk, node: Any, i: int) -> Any:
    if i >= len(node.input) or not node.input[i]:
        return None
    if node.input[i] not in walk.literal:
        raise walk.refuse(f"{node.op_type} {node.name!r} of an image-dependent value takes computed bounds")
    return walk.values(node.input[i])


def _prepare(g: Any, outer_small: dict[str, Any], top: bool = False) -> None:
    """Make the file's graphs say nothing about shapes that inference should work out itself: declared
    value shapes go (a claim, never checked otherwise), the main graph's large stored tensors become typed
    inputs (their data is not needed to infer shapes, and is not copied; a branch takes no inputs), and a
    subgraph gets a copy of the small outer constants it reads (shape inference does not see outer data)."""
    del g.value_info[:]
    stored = {t.name: t for t in g.initializer}
    for o in g.output:  # an output that is a stored tensor has the shape of its data; others are inferred
        if o.name in stored:
            o.type.CopyFrom(_typed(stored[o.name]).type)
        else:
            o.type.tensor_type.ClearField("shape")
    small = dict(outer_small)
    for t in list(g.initializer):
        if _count(t.dims) <= _SMALL:  # (dims match the data: _stored checked it)
            small[t.name] = t
        elif top:
            g.input.add().CopyFrom(_typed(t))
            g.initializer.remove(t)
    for node in g.node:
        for sub in _subgraphs(node):
            names = {t.name for t in sub.initializer}
            for n in sorted(_reads(sub) - names):
                if n in small:
                    sub.initializer.add().CopyFrom(small[n])
            _prepare(sub, small)


def _subgraphs(node: Any) -> list[Any]:
    from onnx import AttributeProto

    return [g for a in node.attribute for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs))]


def _count(dims: Any) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _typed(t: Any) -> Any:
    from onnx import helper

    return helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))


def _reads(g: Any) -> set[str]:
    return {i for node in g.node for i in node.input if i}


def _check_values(walk: _Walk, g: Any, bound: int, constants: set[str]) -> None:
    """Every node output, in this graph and its subgraphs, has a static shape within its bound."""
    types = {v.name: v.type for v in [*g.value_info, *g.output, *g.input]}
    for node in g.node:
        for sub in _subgraphs(node):
            _check_values(walk, sub, bound, constants)
        for o in filter(None, node.output):
            n = _elements(walk, o, types.get(o))
            if walk.kind[o] != "const":
                if n > bound:
                    raise walk.refuse(f"value {o!r} ({node.op_type}) would hold {n} elements, more than the "
                                      f"{bound} its images allow")
            elif o not in constants:
                constants.add(o)
                walk.constant_total += n
                if n > MAX_CONSTANT_ELEMENTS or walk.constant_total > MAX_CONSTANT_TOTAL:
                    raise walk.refuse(f"constant {o!r} ({node.op_type}) would hold {n} elements (at most "
                                      f"{MAX_CONSTANT_ELEMENTS} each, {MAX_CONSTANT_TOTAL} in all)")


def _facts(g: Any) -> tuple[dict[str, Any], dict[str, dict[int, int | None]]]:
    """Across `g` and its subgraphs: the node that makes each value, and each value's inferred dims."""
    producers: dict[str, Any] = {}
    shapes: dict[str, dict[int, int | None]] = {}
    graphs = [g]
    while graphs:
        graph = graphs.pop()
        for v in [*graph.value_info, *graph.output, *graph.input]:
            if v.type.tensor_type.HasField("shape"):
                shapes[v.name] = {j: d.dim_value if d.HasField("dim_value") else None
                                  for j, d in enumerate(v.type.tensor_type.shape.dim)}
        shapes.update((t.name, dict(enumerate(t.dims))) for t in graph.initializer)
        for node in graph.node:
            producers.update((o, node) for o in node.output if o)
            graphs += _subgraphs(node)
    return producers, shapes


def _check_reshapes(walk: _Walk, g: Any) -> None:
    """Each Reshape whose target is made of dims: traced element by element (onnx_dims), with the ranks
    that shape inference gave every value."""
    from torchcls.artifacts.onnx_dims import reshape_problem, trace

    producers, shapes = _facts(g)
    ranks = {name: len(dims) for name, dims in shapes.items()}
    for node in walk.reshapes:
        problem = reshape_problem(node, trace(node.input[1], producers, ranks, walk.values))
        if problem:
            raise walk.refuse(f"Reshape {node.name!r} takes its target from dims of values and {problem}")


def _elements(walk: _Walk, name: str, t: Any) -> int:
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        raise walk.refuse(f"shape inference cannot tell the shape of value {name!r}")
    if t.tensor_type.elem_type not in _DTYPES:
        raise walk.refuse(f"value {name!r} has element type {t.tensor_type.elem_type} (not a number of ≤ 8 bytes)")
    dims = t.tensor_type.shape.dim
    if len(dims) > MAX_RANK or not all(d.HasField("dim_value") for d in dims):
        raise walk.refuse(f"value {name!r} has no static shape "
                          f"({[d.dim_value if d.HasField('dim_value') else '?' for d in dims][:MAX_RANK]})")
    return _count(d.dim_value for d in dims)

"""Bounded before built, for `.onnx` and `.pte` artifacts: what a graph or program can make its runtime
allocate is read from the file and checked before the runtime sees it.

Issue 30 review: a 191-byte .onnx whose graph held ConstantOfShape([2^28]) -> ReduceSum took OnnxArtifact to
2.75 GB (ONNX Runtime folds constants when it creates the session, which came before the metadata check); a
2 KB .pte whose metadata method returned zeros(2^26) took ExecuTorchArtifact to 1.45 GB, and one whose
`forward` planned 2 GiB took 2 GB inside `load_program`. Each bomb here is sized far past its bound (2^30
elements), so a refusal that came after the allocation would fail the RSS bound, not just the match.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bounds_check import Stopwatch, bounded
from torchcls.artifacts.targets.base import ArtifactInfo
from torchcls.data.preprocess import Preprocess
from torchcls.errors import UserError

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

N = 2**30  # elements of every bomb: 4 GiB of float32 had any of them been built


def _info(target: str = "onnx", max_batch: int = 4) -> str:
    return ArtifactInfo("bomb", target, ["a", "b"], Preprocess(32, 3, (0.5,) * 3, (0.25,) * 3), max_batch,
                        "fp32").to_json()


def _ints(name: str, *values: int):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _model(nodes, inits=(), *, extra: str | None = None, batch="N", meta: str | None = None, **graph):
    """An artifact-shaped model: input [batch, 3, 32, 32] -> logits [batch, 2] (a linear layer), plus
    `extra` (a value of the nodes) reduced to a scalar and added to the logits, so the bomb is used."""
    w = numpy_helper.from_array(np.zeros((3072, 2), np.float32), "w")
    head = [helper.make_node("Flatten", ["input"], ["flat"]), helper.make_node("MatMul", ["flat", "w"], ["mm"])]
    if extra:
        head += [helper.make_node("ReduceSum", [extra], ["head_sum"], keepdims=0),
                 helper.make_node("Add", ["mm", "head_sum"], ["logits"])]
    else:
        head += [helper.make_node("Identity", ["mm"], ["logits"])]
    g = helper.make_graph(list(nodes) + head, "g",
                          [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 32, 32])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 2])],
                          initializer=[w, *inits], **graph)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.metadata_props.add(key="torchcls", value=_info() if meta is None else meta)
    return m


def _save(tmp_path: Path, model, name: str = "model.onnx") -> Path:
    path = tmp_path / name
    path.write_bytes(model.SerializeToString())
    return path


def _load_onnx(path: Path):
    from torchcls.artifacts.targets.onnx import OnnxArtifact

    return OnnxArtifact(path, device="cpu", threads=1)


def _refused(path: Path, says: str) -> None:
    with bounded(seconds=10.0, rss_mb=200), pytest.raises(UserError, match=says) as e:
        _load_onnx(path)
    assert str(path) in str(e.value)


ONE = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
CONSTANT_BOMBS = {  # a value of N elements made from constants alone: what session creation folds
    "constant-of-shape": ([helper.make_node("ConstantOfShape", ["n"], ["big"], value=ONE)], [_ints("n", N)]),
    "expand": ([helper.make_node("Expand", ["one", "n"], ["big"])],
               [numpy_helper.from_array(np.ones(1, np.float32), "one"), _ints("n", N)]),
    "tile": ([helper.make_node("Tile", ["one", "n"], ["big"])],
             [numpy_helper.from_array(np.ones(1, np.float32), "one"), _ints("n", N)]),
    "range": ([helper.make_node("Range", ["zero", "limit", "step"], ["big"])],
              [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in
               (("zero", 0.0), ("limit", float(N)), ("step", 1.0))]),
}


@pytest.mark.parametrize("kind", CONSTANT_BOMBS)
def test_constant_bombs_are_refused_before_a_session_exists(tmp_path, kind):
    nodes, inits = CONSTANT_BOMBS[kind]
    # The file also declares the bomb to be one element: a claim the check never reads.
    lie = [helper.make_tensor_value_info("big", TensorProto.FLOAT, [1])]
    _refused(_save(tmp_path, _model(nodes, inits, extra="big", value_info=lie)), r"constant 'big'")


def test_the_reviewers_file_is_refused_on_its_metadata_without_folding(tmp_path):
    """The review's exact graph (ConstantOfShape -> ReduceSum -> Add, metadata "{}"), at 2^30."""
    nodes = [helper.make_node("ConstantOfShape", ["shp"], ["c"], value=ONE),
             helper.make_node("ReduceSum", ["c"], ["s"], keepdims=0), helper.make_node("Add", ["x", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], initializer=[_ints("shp", N)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.metadata_props.add(key="torchcls", value="{}")
    _refused(_save(tmp_path, m), "metadata is unreadable")


def test_a_bomb_inside_an_if_branch_is_refused(tmp_path):
    grow = helper.make_graph([helper.make_node("ConstantOfShape", ["n"], ["big"], value=ONE),
                              helper.make_node("ReduceSum", ["big"], ["r"], keepdims=0)], "else", [],
                             [helper.make_tensor_value_info("r", TensorProto.FLOAT, [])])
    small = helper.make_graph([helper.make_node("Constant", [], ["z"], value=helper.make_tensor(
        "z", TensorProto.FLOAT, [], [0.0]))], "then", [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, [])])
    nodes = [helper.make_node("ReduceMean", ["input"], ["m"], keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["picked"], then_branch=small, else_branch=grow)]
    inits = [_ints("n", N), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    _refused(_save(tmp_path, _model(nodes, inits, extra="picked")), r"constant 'big'")


def test_constants_are_bounded_in_all(tmp_path):
    from torchcls.artifacts.onnx_bounds import MAX_CONSTANT_ELEMENTS, MAX_CONSTANT_TOTAL

    count = MAX_CONSTANT_TOTAL // MAX_CONSTANT_ELEMENTS + 1  # each within its bound, too many together
    nodes = [helper.make_node("ConstantOfShape", ["n"], [f"c{i}"], value=ONE) for i in range(count)]
    nodes.append(helper.make_node("Sum", [f"c{i}" for i in range(count)], ["all"]))
    _refused(_save(tmp_path, _model(nodes, [_ints("n", MAX_CONSTANT_ELEMENTS)], extra="all")), "in all")


def test_a_huge_declared_input_is_refused(tmp_path):
    _refused(_save(tmp_path, _model([], batch=2**40)), "declared for batches of 1099511627776")
    odd = _model([])
    odd.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 2**20
    _refused(_save(tmp_path, odd, "odd.onnx"), "metadata says images of")


def test_an_image_value_beyond_its_bound_is_refused(tmp_path):
    """Tile of the images themselves: every element depends on the input, none is folded, but running it
    once would take 3 x 32 x 32 x 2^20 elements per image."""
    nodes = [helper.make_node("Tile", ["input", "reps"], ["big"])]
    _refused(_save(tmp_path, _model(nodes, [_ints("reps", 1, 1, 1024, 1024)], extra="big")), "its images allow")


def test_a_value_that_does_not_grow_with_the_batch_is_bounded_at_batch_one(tmp_path):
    """Within the bound for 4096 images, but as large for one: the graph is checked at a batch of 1 too."""
    nodes = [helper.make_node("ReduceMean", ["input"], ["m"], keepdims=0),
             helper.make_node("Expand", ["m", "shape"], ["big"])]
    model = _model(nodes, [_ints("shape", 2**28)], extra="big", meta=_info(max_batch=4096))
    _refused(_save(tmp_path, model), "more than the 4194304 its images allow")


SIZES_FROM_IMAGES = {  # a size computed from the batch: it could peak at a batch the check never sees
    "arithmetic": ([helper.make_node("Shape", ["input"], ["s"], end=1), helper.make_node("Mul", ["s", "k"], ["n"]),
                    helper.make_node("ConstantOfShape", ["n"], ["big"], value=ONE)], [_ints("k", 2**20)],
                   "takes its shape from the images"),
    "reshape-target": ([helper.make_node("Shape", ["input"], ["s"], end=1),
                        helper.make_node("Concat", ["s", "minus"], ["t"], axis=0),
                        helper.make_node("Reshape", ["data", "t"], ["big"])],
                       [_ints("minus", -1), numpy_helper.from_array(np.zeros(4096, np.float32), "data")],
                       "divides by dims that are not distinct dims of the value it reshapes"),
    "range-down": ([helper.make_node("Shape", ["input"], ["s"], start=0, end=1),
                    helper.make_node("Squeeze", ["s"], ["b"]), helper.make_node("Range", ["hi", "b", "down"], ["r"]),
                    helper.make_node("Cast", ["r"], ["big"], to=TensorProto.FLOAT)],
                   [numpy_helper.from_array(np.array(2**30, np.int64), "hi"),
                    numpy_helper.from_array(np.array(-1, np.int64), "down")], "a positive step"),
    "slice-triangle": ([helper.make_node("Slice", ["input", "st", "en", "ax"], ["big"])],
                       [_ints("st", -40), _ints("en", 37), _ints("ax", 0)], "can shrink"),
}


@pytest.mark.parametrize("kind", SIZES_FROM_IMAGES)
def test_sizes_taken_from_the_images_are_refused(tmp_path, kind):
    nodes, inits, says = SIZES_FROM_IMAGES[kind]
    _refused(_save(tmp_path, _model(nodes, inits, extra="big")), says)


def _structure_cases():
    loop_body = helper.make_graph([helper.make_node("Identity", ["cond"], ["cond_out"])], "body",
                                  [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                   helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                                  [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])])
    sparse = helper.make_sparse_tensor(helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
                                       helper.make_tensor("i", TensorProto.INT64, [1], [0]), [N])
    external = TensorProto(name="ext", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    external.external_data.add(key="location", value="../../etc/passwd")
    short = TensorProto(name="short", data_type=TensorProto.FLOAT, dims=[N], raw_data=b"\0" * 4)
    return {
        "loop": ([helper.make_node("Loop", ["trips", ""], [], body=loop_body)], [_ints("trips", 2**62)],
                 "operator Loop"),
        "other-domain": ([helper.make_node("Gelu", ["input"], ["g"], domain="com.microsoft")], [], "operator com"),
        "sparse-constant": ([helper.make_node("Constant", [], ["big"], sparse_value=sparse)], [], "sparse"),
        "external-data": ([helper.make_node("Identity", ["ext"], ["e"])], [external], "in another file"),
        "short-data": ([helper.make_node("Identity", ["short"], ["e"])], [short], "stores 1 elements"),
    }


@pytest.mark.parametrize("kind", list(_structure_cases()))
def test_what_torchcls_never_exports_is_refused(tmp_path, kind):
    nodes, inits, says = _structure_cases()[kind]
    _refused(_save(tmp_path, _model(nodes, inits)), says)


def test_the_file_size_is_bounded_before_it_is_read(tmp_path, monkeypatch):
    from torchcls.artifacts import onnx_bounds

    monkeypatch.setattr(onnx_bounds, "MAX_ONNX_BYTES", 1000)
    _refused(_save(tmp_path, _model([])), "at most 1000 bytes")


def test_a_well_formed_graph_loads_and_runs(tmp_path):
    """The control: the same shape of file with nothing oversized loads, with its declared batch name, and
    with the sizes taken from dims that exports of timm models hold: zeros_like/expand (Expand of a Shape),
    a transformer's reshape(-1, *x.shape[1:]) and ConvNeXt's arange(B) (Range to a dim)."""
    nodes = [helper.make_node("Shape", ["input"], ["s"]), helper.make_node("Expand", ["one", "s"], ["ones"]),
             helper.make_node("Slice", ["ones", "st", "en", "ax"], ["tail"]),
             helper.make_node("Shape", ["tail"], ["last"], start=1),
             helper.make_node("Concat", ["minus", "last"], ["target"], axis=0),
             helper.make_node("Reshape", ["tail", "target"], ["rows"]),
             helper.make_node("Shape", ["input"], ["s0"], end=1), helper.make_node("Squeeze", ["s0"], ["b"]),
             helper.make_node("Range", ["zero", "b", "step"], ["r"]),
             helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["rf", "one_axis"], ["col"]), helper.make_node("Mul", ["rows", "col"], ["all"])]
    inits = [numpy_helper.from_array(np.ones(1, np.float32), "one"), _ints("st", -1), _ints("en", 2**63 - 1),
             _ints("ax", 3), _ints("minus", -1), _ints("one_axis", 1, 2, 3),
             *(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (("zero", 0), ("step", 1)))]
    art = _load_onnx(_save(tmp_path, _model(nodes, inits, extra="all")))
    out = art(torch.zeros(3, 3, 32, 32))  # rows: 3 x 3 x 32 ones, each times its image's index 0, 1, 2
    assert out.shape == (3, 2) and torch.allclose(out, torch.full((3, 2), 3.0 * 32 * 3))


# --- the protobuf parse itself (onnx_bounds.read_model, protobuf_scan) -------------------------------------
# Parsing builds every message and repeated element on the wire before any bound on the graph can run: an
# empty node is 2 bytes in a file and ~150 once parsed. Each file here is a valid artifact-shaped model with
# malicious fields after it (protobuf merges a message's occurrences, so they land in its graph), a few MB
# sized past a bound and, where the parse would keep more than the file's bytes, so that it would take more
# than the 200 MB `_refused` allows (250-390 MB measured, onnx 1.23 on upb).


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(number: int, body: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def _nest(levels: int, wrap) -> bytes:
    body = b""
    for _ in range(levels):
        body = wrap(body)
    return body


GRAPH, OPSET, META, NODE, INIT, VALUE_INFO = 7, 8, 14, 1, 5, 13  # ModelProto.graph ..., GraphProto.node ...
EMPTY = b"\x00"  # a length of 0: an empty message or string
WIRE_BOMBS = {  # what is appended to a valid model (built when its test runs) -> what the refusal says
    "empty-nodes": (lambda: _ld(GRAPH, (_varint(NODE << 3 | 2) + EMPTY) * 2_000_000), "more than 100000 nodes"),
    "empty-attributes": (lambda: _ld(GRAPH, _ld(NODE, b"\x2a\x00" * 2_000_000)),
                         "more than 1048576 protobuf messages"),
    "opset-imports": (lambda: (_varint(OPSET << 3 | 2) + EMPTY) * 6_000_000, "more than 1048576 protobuf messages"),
    "metadata-props": (lambda: (_varint(META << 3 | 2) + EMPTY) * 6_000_000, "more than 1048576 protobuf messages"),
    "value-infos": (lambda: _ld(GRAPH, (_varint(VALUE_INFO << 3 | 2) + EMPTY) * 4_000_000), "protobuf messages"),
    "packed-int64": (lambda: _ld(GRAPH, _ld(INIT, _ld(7, b"\x01" * 2**24))), "more than 4194304 protobuf fields"),
    "packed-ints-attribute": (lambda: _ld(GRAPH, _ld(NODE, _ld(5, _ld(8, b"\x7f" * 2**24)))), "protobuf fields"),
    "unpacked-int64": (lambda: _ld(GRAPH, _ld(INIT, b"\x38\x01" * 2**24)), "more than 4194304 protobuf fields"),
    "node-input-names": (lambda: _ld(GRAPH, _ld(NODE, b"\x0a\x00" * 8_000_000)), "more than 4194304 protobuf fields"),
    # Kept as the bytes they are (as much memory parsed as in the file), but each one is a step of the scan
    "unknown-fields": (lambda: b"\x78\x00" * 5_000_000, "more than 4194304 protobuf fields"),  # ModelProto has no 15
    "unknown-in-a-node": (lambda: _ld(GRAPH, _ld(NODE, (_varint(1000 << 3) + b"\x01") * 4_200_000)),
                          "protobuf fields"),
    # Deeper than protobuf's parser goes (it refuses them itself): refused as clearly, before it runs.
    # GraphProto.node -> NodeProto.attribute -> AttributeProto.g: 3 messages a level, 34 levels of If
    "nested-subgraphs": (lambda: _ld(GRAPH, _nest(34, lambda g: _ld(NODE, _ld(5, _ld(6, g))))),
                         "nest deeper than 100"),
    # ValueInfoProto.type -> TypeProto.sequence_type -> TypeProto.Sequence.elem_type -> TypeProto ...
    "nested-types": (lambda: _ld(GRAPH, _ld(VALUE_INFO, _ld(2, _nest(60, lambda t: _ld(4, _ld(1, t)))))),
                     "nest deeper than 100"),
}


@pytest.mark.parametrize("kind", WIRE_BOMBS)
def test_what_the_protobuf_parse_would_build_is_bounded_before_it_runs(tmp_path, kind):
    extra, says = WIRE_BOMBS[kind]
    path = tmp_path / "model.onnx"
    path.write_bytes(_model([]).SerializeToString() + extra())
    _refused(path, says)


WIRE_DAMAGE = {  # not protobuf at all -> where the reader stops
    "varint-past-10-bytes": (_varint(GRAPH << 3 | 2) + b"\x80" * 10 + b"\x01", "a varint longer than 10 bytes"),
    "length-past-the-end": (_varint(GRAPH << 3 | 2) + _varint(2**31 - 2) + _ld(NODE, b""),
                            "a length of 2147483646 bytes runs past the end"),
    "length-past-its-message": (_ld(GRAPH, _varint(NODE << 3 | 2) + b"\x05" + b"\x00" * 4) + b"\x00" * 8,
                                "a length of 5 bytes runs past the end of its message"),
    "truncated-varint": (b"\x78\x80", "a varint runs past the end"),
    "truncated-fixed": (b"\x7d\x00\x00", "a fixed-width field runs past"),
    "packed-varint-cut": (_ld(GRAPH, _ld(INIT, _ld(7, b"\x01\x81"))), "a packed varint runs past"),
    "group": (b"\x7b", "wire type 3"),
    "field-zero": (b"\x02\x00", "field number 0"),
}


@pytest.mark.parametrize("kind", WIRE_DAMAGE)
def test_damaged_wire_data_is_refused_before_the_parse(tmp_path, kind):
    extra, says = WIRE_DAMAGE[kind]
    path = tmp_path / "model.onnx"
    path.write_bytes(_model([]).SerializeToString() + extra)
    _refused(path, f"is not a loadable ONNX model \\(byte \\d+: {says}")


def _parsed_counts(message) -> tuple[int, int]:
    """(fields, messages) the way protobuf_scan counts them, from a parsed message (no unknown fields)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    fields, messages = 0, 1
    for f, value in message.ListFields():
        items = list(value) if f.is_repeated else [value]
        if f.type == F.TYPE_MESSAGE:
            for m in items:
                sub = _parsed_counts(m)
                fields, messages = fields + 1 + sub[0], messages + sub[1]
        elif f.is_packed and f.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE, F.TYPE_FIXED32, F.TYPE_FIXED64,
                                        F.TYPE_SFIXED32, F.TYPE_SFIXED64):  # one field, read by its length
            fields += 1
        else:
            fields += len(items)
    return fields, messages


def test_the_scan_counts_what_the_parse_builds(tmp_path):
    """A real export (torch.onnx of a SmallNet, through the exporter's own capture and build) and the
    helper-made models above: the scan's counts are exactly what the parse built, and the export loads."""
    from torchcls.artifacts import onnx_bounds
    from torchcls.artifacts.exporter import capture
    from torchcls.artifacts.protobuf_scan import scan
    from torchcls.artifacts.targets import onnx as onnx_target
    from torchcls.models.smallnet import SmallNet

    info = ArtifactInfo("small", "onnx", ["a", "b"], Preprocess(32, 3, (0.5,) * 3, (0.25,) * 3), 4, "fp32")
    torch.manual_seed(0)
    path = tmp_path / "real.onnx"
    onnx_target.build(capture(SmallNet(num_classes=2, in_chans=3), info), info, path, {})
    loop = helper.make_graph([helper.make_node("Identity", ["c"], ["d"])], "b", [], [
        helper.make_tensor_value_info("d", TensorProto.BOOL, [])])
    odd = _model([helper.make_node("Loop", ["t", ""], ["o"], body=loop, floats=[1.0, 2.0], ints=[3, 300, -1])],
                 [_ints("t", 1, 2, 3), helper.make_tensor("f", TensorProto.FLOAT, [2], [1.0, 2.0])])
    for data in (path.read_bytes(), _model(*CONSTANT_BOMBS["range"]).SerializeToString(), odd.SerializeToString()):
        counts = scan(data, onnx.ModelProto.DESCRIPTOR, max_fields=onnx_bounds.MAX_PROTOBUF_FIELDS,
                      max_messages=onnx_bounds.MAX_PROTOBUF_MESSAGES, max_depth=onnx_bounds.MAX_MESSAGE_DEPTH)
        assert (counts.fields, counts.messages) == _parsed_counts(onnx.load_model_from_string(data))
    out = _load_onnx(path)(torch.zeros(3, 3, 32, 32))
    assert out.shape == (3, 2) and torch.isfinite(out).all()


def test_the_scan_bounds_are_inclusive():
    from torchcls.artifacts.protobuf_scan import ScanError, scan

    nodes = _ld(GRAPH, (_varint(NODE << 3 | 2) + EMPTY) * 10)  # 11 fields, 12 messages (with the model)
    limits = {"onnx.NodeProto": (10, "nodes")}
    counts = scan(nodes, onnx.ModelProto.DESCRIPTOR, max_fields=11, max_messages=12, max_depth=2, limits=limits)
    assert (counts.fields, counts.messages, counts.depth, counts.by_type["onnx.NodeProto"]) == (11, 12, 2, 10)
    for bounds, says in (((10, 12, 2, 10), "more than 10 protobuf fields"), ((11, 11, 2, 10), "11 protobuf messages"),
                         ((11, 12, 1, 10), "deeper than 1"), ((11, 12, 2, 9), "more than 9 nodes")):
        with pytest.raises(ScanError, match=says) as e:
            scan(nodes, onnx.ModelProto.DESCRIPTOR, max_fields=bounds[0], max_messages=bounds[1],
                 max_depth=bounds[2], limits={"onnx.NodeProto": (bounds[3], "nodes")})
        assert not e.value.malformed
    packed = _ld(GRAPH, _ld(INIT, _ld(7, b"\x01\x81\x01\xff\xff\x7f" * 4)))  # 12 varints, one field on the wire
    assert scan(packed, onnx.ModelProto.DESCRIPTOR, max_fields=14, max_messages=3, max_depth=2).fields == 14
    with pytest.raises(ScanError, match="more than 13 protobuf fields"):
        scan(packed, onnx.ModelProto.DESCRIPTOR, max_fields=13, max_messages=3, max_depth=2)


# --- ExecuTorch ---------------------------------------------------------------------------------------------

pte_size = 2**29  # float32 elements planned by the forward bomb: 2 GiB


def _program(forward: torch.nn.Module, meta: torch.Tensor | torch.nn.Module, example=(torch.zeros(4, 3, 32, 32),),
             extra: dict | None = None) -> bytes:
    """A .pte with `forward` and a metadata method: a constant (what torchcls writes) or a module."""
    from executorch.exir import to_edge

    methods = {"forward": torch.export.export(forward, example)}
    constants = None
    if isinstance(meta, torch.Tensor):
        constants = {"torchcls_metadata": meta}
    else:
        methods["torchcls_metadata"] = torch.export.export(meta, ())
    for name, module in (extra or {}).items():
        methods[name] = torch.export.export(module, example)
    return to_edge(methods, constant_methods=constants).to_executorch().buffer


class _Head(torch.nn.Module):
    def forward(self, x):
        return (x.mean(dim=(2, 3))[:, :2],)


class _Zeros(torch.nn.Module):  # the review's metadata method: returns 2^30 bytes, planned
    def forward(self):
        return torch.zeros(N, dtype=torch.uint8)


class _Plans(torch.nn.Module):  # a forward whose planned buffers hold 2 GiB whatever its input
    def forward(self, x):
        return ((x.reshape(-1)[:2] + torch.ones(pte_size)[:2]).reshape(1, 2).expand(x.shape[0], 2),)


def _meta_bytes(**kw) -> torch.Tensor:
    return torch.tensor(list(_info("executorch", **kw).encode()), dtype=torch.uint8)


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("executorch.exir")
    folder = tmp_path_factory.mktemp("pte")
    built = {"good": _program(_Head(), _meta_bytes()),
             "metadata-bomb": _program(_Head(), _Zeros()),
             "forward-bomb": _program(_Plans(), _meta_bytes()),
             "shape-mismatch": _program(_Head(), _meta_bytes(max_batch=8)),
             "extra-method": _program(_Head(), _meta_bytes(), extra={"other": _Head()})}
    paths = {}
    for name, data in built.items():
        paths[name] = folder / f"{name}.pte"
        paths[name].write_bytes(data)
    return paths


def test_a_good_program_loads(programs):
    from torchcls.artifacts.targets.executorch import ExecuTorchArtifact

    art = ExecuTorchArtifact(programs["good"])
    assert art.info.classes == ["a", "b"] and art(torch.ones(4, 3, 32, 32)).shape == (4, 2)


@pytest.mark.parametrize("name, says", [
    ("metadata-bomb", "metadata method takes inputs or plans 1073741824 bytes"),
    ("forward-bomb", "forward method plans 2147483"),
    ("shape-mismatch", r"planned for inputs of \[4, 3, 32, 32\], its metadata says \[8, 3, 32, 32\]"),
    ("extra-method", "it has methods"),
])
def test_programs_are_bounded_before_the_runtime_loads_them(programs, name, says):
    from torchcls.artifacts.targets.executorch import ExecuTorchArtifact

    with bounded(seconds=10.0, rss_mb=200), pytest.raises(UserError, match=says) as e:
        ExecuTorchArtifact(programs[name])
    assert str(programs[name]) in str(e.value)


def test_the_flatbuffer_reader_refuses_any_damage_in_words(programs):
    """The hand-written reader of planned sizes meets every truncation and byte flip of a real program with a
    result or a UserError, never an exception of its own, and in bounded time."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from torchcls.artifacts.pte_bounds import read_plans

    data = programs["good"].read_bytes()
    head = min(len(data), 4096)  # the flatbuffer's tables (weights, if any, follow them)

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, head - 1), st.integers(0, 255), st.integers(8, len(data)))
    def damaged(at: int, byte: int, keep: int) -> None:
        broken = bytearray(data[:keep])
        if at < len(broken):
            broken[at] = byte
        watch = Stopwatch()
        try:
            read_plans(bytes(broken), Path("x.pte"))
        except UserError:
            pass
        assert watch.seconds() < 1

    damaged()

"""Which ONNX operators an `.onnx` artifact may hold, and which of their inputs are sizes.

An operator's output shape is a function of its inputs' shapes and, for some operators, of the
*values* of some inputs (a Reshape's target, a Slice's ends, a ConstantOfShape's shape): those inputs
are listed here as sizes. `onnx_bounds` requires every size to be a constant of the file (the same for
every batch), except that Expand, ConstantOfShape, Tile, Reshape and Range may also take dims of other
values (`Shape` and plain rearrangements of it: what `zeros_like`, `expand(B, ...)`, a transformer's
`reshape(-1, *x.shape[-2:])` and `arange(B)` export to; see `onnx_dims` for the Reshape's -1). With constant
sizes, every operator below makes each output dim a non-decreasing function of its input dims (a
broadcast takes the larger, a convolution or pooling window slides further, a Reshape's -1 grows with
its input, a Split divides by a constant), Slice only under `slice_is_monotone`. So every value grows
with the batch, and checking the graph at the largest batch bounds it at every batch.

Operators whose output shape depends on data (NonZero, Unique, Compress, NonMaxSuppression), loops
(Loop, Scan: an iteration count from the file), sequences, and other domains (com.microsoft) are not
listed: torchcls exports none of them, and a file that holds one is refused before a session exists.
"""

from __future__ import annotations

from typing import Any

# Output dims are taken from input dims only (broadcast, windowed, contracted, permuted, concatenated).
SHAPE_ONLY = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization BitShift BitwiseAnd
BitwiseNot BitwiseOr BitwiseXor Cast CastLike Ceil Celu Clip Concat Constant Conv ConvInteger ConvTranspose Cos
Cosh CumSum DepthToSpace DequantizeLinear Det Div Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp
EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool
Greater GreaterOrEqual GridSample GroupNormalization HardSigmoid HardSwish Hardmax Identity If
InstanceNormalization IsInf IsNaN LRN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax LpNormalization
LpPool MatMul MatMulInteger Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg Not Or PRelu Pow
QLinearConv QLinearMatMul QuantizeLinear Reciprocal Relu Round ScatterElements ScatterND Selu Shape Shrink Sigmoid
Sign Sin Sinh Size Softmax Softplus Softsign SpaceToDepth Sqrt Sub Sum Tan Tanh ThresholdedRelu Transpose Trilu
Where Xor
""".split())

_REDUCE = ("ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum "
           "ReduceSumSquare").split()
# Operator -> the positions of its inputs that are sizes (shapes, extents, repeats, axes, counts).
SIZE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "ConstantOfShape": (0,), "Tile": (1,), "Range": (0, 1, 2), "Pad": (1, 3),
    "Slice": (1, 2, 3, 4), "Resize": (1, 2, 3), "Upsample": (1,), "Split": (1,), "Squeeze": (1,),
    "Unsqueeze": (1,), "TopK": (1,), "OneHot": (1,), "CenterCropPad": (1,), **{r: (1,) for r in _REDUCE},
}
# Sizes that may also be dims of other values: each output dim is then a dim of a value (or a constant);
# a Reshape's target and a Range's limit under the further conditions `onnx_dims` and `onnx_bounds` check.
DIMS_ALLOWED = {("Expand", 1), ("ConstantOfShape", 0), ("Tile", 1), ("Reshape", 1), ("Range", 1)}
# Operators that only rearrange a vector of dims: their output is dims again when their data inputs are.
DIM_PLUMBING = {"Concat": None, "Gather": (0,), "Slice": (0,), "Squeeze": (0,), "Unsqueeze": (0,),
                "Identity": (0,), "Reshape": (0,), "Cast": (0,)}

ALLOWED = SHAPE_ONLY | SIZE_INPUTS.keys()
DOMAINS = ("", "ai.onnx")
MIN_OPSET = 13  # sizes are inputs (Squeeze axes, Split sizes...) from 13 on; torchcls exports use 18+
BIG = 2**62  # a Slice end at or past this means "to the end" (how exporters write x[k:] and x[::-1])


def slice_is_monotone(start: int, end: int, step: int) -> bool:
    """Whether `x[start:end:step]` along a dim of size d has a length that never shrinks as d grows.

    Not so for a start counted from the end and an end counted from the front (x[-40:37] has 37 elements
    at d = 37 and none at d = 77), nor for a reverse slice that does not run from the last element
    through the first: a batch-dependent Slice of that kind could peak at a batch the check never sees.
    """
    if step > 0:
        return not (start < 0 <= end < BIG)
    return step < 0 and (start < 0 or start >= BIG) and end <= -BIG


def data_inputs(op: str, inputs: list[str]) -> list[str]:
    """The inputs of a dim-plumbing node that carry dims (the others are indices, axes, targets)."""
    where = DIM_PLUMBING[op]
    return [n for i, n in enumerate(inputs) if n and (where is None or i in where)]


def describe(op: str, index: int) -> str:
    names: dict[str, Any] = {"Reshape": "target shape", "Expand": "shape", "ConstantOfShape": "shape",
                             "Tile": "repeats", "Slice": "starts/ends/axes/steps", "Pad": "pads",
                             "Resize": "scales/sizes", "Range": "start/limit/delta"}
    return names.get(op, f"input {index}")

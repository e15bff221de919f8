"""Point convolutions over a 1x1 map, as reductions, in a static batch-1 program.

Squeeze-and-excitation blocks (MobileNetV3, EfficientNet, RegNetY) and MobileNetV3's head apply 1x1 convolutions
to a pooled, 1x1 feature map: a matrix-vector product. Frozen Inductor code runs each one as a oneDNN convolution,
whose fixed cost per call is what such a product costs: MobileNetV3-Large's 17 of them took ~1 ms of a 4.3 ms
bf16 batch-1 forward. Written as an elementwise product and a sum, Inductor generates the loop itself (and fuses it
with its neighbours): its bf16 batch-1 model ran 8-18% faster (docs/benchmarks.md, "Point convolutions as
sums"). Only the batch-1 model is rewritten, where it was measured (at batch N the sums do N times the work,
and oneDNN's fixed cost is shared by N images), and only convolutions with a float weight: a quantized one (its
weight the output of a dequantize) runs as oneDNN's int8 kernel, and the int8 batch-1 model was no faster with its
point convolutions as sums.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten


def point_convs_as_reductions(gm: torch.fx.GraphModule) -> int:
    """Rewrite, in place, each `aten.conv2d` of `gm` whose input map is 1x1 and whose kernel is a 1x1 float weight
    of the module (no padding, one group) as `sum(x[:, None, :] * w, -1) + b`, shaped back to (N, O, 1, 1)
    (stride and dilation do not change such a convolution). Reads the shapes export recorded (`meta["val"]`);
    returns how many were rewritten."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if not _is_point_conv(node):
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        out_ch, in_ch = node.args[1].meta["val"].shape[:2]
        with graph.inserting_before(node):
            rows = graph.call_function(_aten.flatten.using_ints, (x, 1))
            rows = graph.call_function(_aten.unsqueeze.default, (rows, 1))
            weights = graph.call_function(_aten.view.default, (w, [out_ch, in_ch]))
            y = graph.call_function(_aten.sum.dim_IntList,
                                    (graph.call_function(_aten.mul.Tensor, (rows, weights)), [-1]))
            if bias is not None:
                y = graph.call_function(_aten.add.Tensor, (y, bias))
            for _ in range(2):  # (N, O) -> (N, O, 1, 1)
                y = graph.call_function(_aten.unsqueeze.default, (y, -1))
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def _is_point_conv(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _aten.conv2d.default:
        return False
    if not isinstance(node.args[1], torch.fx.Node) or node.args[1].op != "get_attr":  # a dequantized weight
        return False
    x, w = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
    if x is None or w is None or x.dim() != 4:
        return False
    padding = node.args[4] if len(node.args) > 4 else 0
    groups = node.args[6] if len(node.args) > 6 else 1
    padded = any(padding) if isinstance(padding, (list, tuple)) else padding != 0
    return tuple(x.shape[-2:]) == (1, 1) and tuple(w.shape[-2:]) == (1, 1) and groups == 1 and not padded

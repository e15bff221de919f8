"""Point convolutions over a 1x1 map become sums in a .pt2's batch-1 model, and compute what they did."""

import pytest
import timm
import torch
import torch.nn as nn

from torchcls.artifacts.point_convs import point_convs_as_reductions


class TinySE(nn.Module):
    """A stem, a 1x1 convolution on a 4x4 map (kept), squeeze-and-excitation (two point convolutions over the
    pooled 1x1 map) and a head convolution over the pooled map (three rewritten), then a linear classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, stride=2, padding=1)
        self.expand = nn.Conv2d(8, 16, 1)
        self.reduce_se, self.expand_se = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.head = nn.Conv2d(16, 32, 1, bias=False)
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        x = self.expand(torch.relu(self.stem(x)))
        gate = torch.sigmoid(self.expand_se(torch.relu(self.reduce_se(x.mean((2, 3), keepdim=True)))))
        return self.fc(self.head((x * gate).mean((2, 3), keepdim=True)).flatten(1))


def _convs(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.conv2d.default)


def _se_and_head(model):
    """timm's MobileNetV3: every squeeze-and-excitation convolution, and the head."""
    return 1 + sum(1 for name, _ in model.named_modules() if name.endswith((".conv_reduce", ".conv_expand")))


@pytest.mark.parametrize("make, size, rewritten", [
    (TinySE, 8, lambda model: 3),
    (lambda: timm.create_model("mobilenetv3_small_050", num_classes=3, in_chans=1), 64, _se_and_head),  # last map 2x2
], ids=["tiny-se", "mobilenetv3"])
def test_only_point_convolutions_over_a_1x1_map_are_rewritten_and_the_output_is_the_same(make, size, rewritten):
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(1, 1, size, size)
    gm = torch.export.export(model, (x,)).module()
    before, expected = _convs(gm), rewritten(model)
    assert point_convs_as_reductions(gm) == expected
    assert _convs(gm) == before - expected
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-5)
    assert point_convs_as_reductions(gm) == 0  # nothing left to rewrite


def test_quantized_point_convolutions_stay_convolutions():
    """int8: a dequantized weight marks a convolution oneDNN runs in int8; as sums it was no faster."""
    from torchcls.artifacts.quantize import quantize_int8_x86

    torch.manual_seed(0)
    x = torch.randn(1, 1, 8, 8)
    quantized = quantize_int8_x86(torch.export.export(TinySE().eval(), (x,)), torch.randn(8, 1, 8, 8), batch=1)
    gm = quantized.module()
    before = _convs(gm)
    assert before == 5 and point_convs_as_reductions(gm) == 0 and _convs(gm) == before


@pytest.mark.parametrize("bound", [64, 1])
def test_a_pt2s_batch1_model_runs_its_point_convolutions_as_sums_and_agrees_with_eager(tmp_path, bound):
    """At the default bound the package's `batch1` model is rewritten and its dynamic `model` is not; a package bound
    to batch 1 is one batch-1 model, rewritten alike."""
    from torchcls.artifacts.targets import aoti
    from torchcls.artifacts.targets.base import ArtifactInfo
    from torchcls.data import Preprocess

    torch.manual_seed(0)
    model = TinySE().eval()
    x = torch.randn(3, 1, 8, 8)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=bound)},) if bound > 1 else None
    ep = torch.export.export(model, (x[:2] if dynamic else x[:1],), dynamic_shapes=dynamic)
    info = ArtifactInfo("tiny-se", "aoti", ["a", "b", "c"], Preprocess(8, 1, (0.5,), (0.5,)), bound, "fp32")
    report = aoti.build(ep, info, tmp_path / "se.pt2", {})
    assert report == ({"models": ["model", "batch1"]} if dynamic else {}) | {"batch1_point_convs_as_sums": 3}
    artifact = aoti.TARGET.load(tmp_path / "se.pt2")
    with torch.no_grad():
        for batch in (x[:1], x) if dynamic else (x[:1],):  # the batch-1 model (rewritten), the dynamic one (as exported)
            assert torch.allclose(artifact(batch), model(batch), atol=1e-5)

"""The FP8 layer rule: torchao's roofline re-derived (its figures for the shapes issue 25 names), a measured
table taking precedence where it covers a shape on its own GPU, the tokens each Linear sees per step
(measured on fake tensors), and apply_precision reporting every layer's decision with its reason.
Pure arithmetic and shape-only forwards: no FP8 GEMM runs here."""

import json

import pytest
import torch
from torch import nn

from torchcls.config import PrecisionConfig
from torchcls.errors import UserError
from torchcls.precision.fp8_layers import eligibility, linear_tokens
from torchcls.precision.fp8_rule import (
    FIGURES,
    ROOFLINE_MIN_SPEEDUP,
    MeasuredTable,
    ShapeRule,
    figures_for,
    roofline_speedup,
)
from torchcls.precision.training import apply_precision

VIT_H_MLP = (8224, 1280, 5120)  # 32 images x 257 tokens, ViT-H/14's fc1


def test_roofline_matches_torchaos_model_for_the_vit_h_mlp():
    """torchao's roofline_utils gives about 1.10x tensorwise / 0.98x rowwise at its H100 figures for this
    shape, and about 1.40x / 1.31x at H200 bandwidth; the ceiling grows with the GEMM and tends to 2x."""
    h100, h200 = FIGURES["H100"], FIGURES["H200"]
    assert roofline_speedup(*VIT_H_MLP, "tensorwise", h100) == pytest.approx(1.10, abs=0.01)
    assert roofline_speedup(*VIT_H_MLP, "rowwise", h100) == pytest.approx(0.98, abs=0.01)
    assert roofline_speedup(*VIT_H_MLP, "tensorwise", h200) == pytest.approx(1.40, abs=0.01)
    assert roofline_speedup(*VIT_H_MLP, "rowwise", h200) == pytest.approx(1.31, abs=0.01)
    # fc2 (K and N swapped) has the same three GEMMs
    assert roofline_speedup(8224, 5120, 1280, "rowwise", h200) == pytest.approx(1.31, abs=0.01)
    small, big = roofline_speedup(1024, 1024, 1024, "tensorwise", h100), roofline_speedup(16384, 16384, 16384,
                                                                                         "tensorwise", h100)
    assert small < 1.0 < big < 2.0
    assert figures_for("NVIDIA H200") is h200 and figures_for("NVIDIA H100 80GB HBM3") is h100
    assert "no GPU here" in figures_for("").label and figures_for("").bytes_per_s == h100.bytes_per_s


def test_shape_rule_decides_from_the_roofline_and_says_why():
    h200, h100 = ShapeRule("tensorwise", "NVIDIA H200"), ShapeRule("tensorwise", "NVIDIA H100 80GB HBM3")
    ok, speedup, why = h200.verdict(*VIT_H_MLP)
    assert ok and speedup >= ROOFLINE_MIN_SPEEDUP and why.startswith("pays: roofline ceiling 1.40x")
    assert "M=8224 tokens, K=1280, N=5120" in why and "H200 figures" in why
    ok, _, why = h100.verdict(*VIT_H_MLP)
    assert not ok and why.startswith("too small for FP8 to pay: roofline ceiling 1.10x < 1.3x")
    assert not h200.verdict(8192 * 4, 64, 192)[0]  # narrow layers never pay, however many tokens


def write_table(path, gpu="NVIDIA H200", rows=None):
    rows = rows if rows is not None else [
        {"m": 16448, "k": 1280, "n": 5120, "recipe": "tensorwise", "linear_speedup": 0.93},
        {"m": 16448, "k": 1664, "n": 8192, "recipe": "tensorwise", "linear_speedup": 1.21},
        {"m": 16448, "k": 1664, "n": 8192, "recipe": "rowwise", "linear_speedup": None},  # failed: ignored
    ]
    path.write_text(json.dumps({"gpu": gpu, "rows": rows}))
    return path


def test_a_measured_table_overrides_the_roofline_where_it_covers_the_shape(tmp_path):
    table = MeasuredTable.load(write_table(tmp_path / "t.json"))
    rule = ShapeRule("tensorwise", "NVIDIA H200", table)
    ok, speedup, why = rule.verdict(*VIT_H_MLP)  # M 8224 is within 2x of the measured 16448
    assert not ok and speedup == 0.93 and "measured 0.93x at M=16448 on NVIDIA H200" in why
    assert rule.verdict(16448, 1664, 8192)[:2] == (True, 1.21)
    assert "roofline" in rule.verdict(4096, 1280, 5120)[2]  # M 4x away from the measured row
    assert "roofline" in ShapeRule("rowwise", "NVIDIA H200", table).verdict(16448, 1664, 8192)[2]
    other_gpu = ShapeRule("tensorwise", "NVIDIA H100 80GB HBM3", table)  # measured elsewhere: not used
    assert "roofline" in other_gpu.verdict(*VIT_H_MLP)[2] and "measured table" not in other_gpu.describe()
    assert "measured table" in rule.describe()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="--fp8-table .*bad.json: not a table written by benchmarks/gpu/fp8_gemm.py"):
        MeasuredTable.load(tmp_path / "bad.json")


def tiny_vit() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_ratio=3,
                             num_classes=10)


def test_linear_tokens_are_measured_on_fake_tensors_without_touching_the_model():
    model = tiny_vit().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    tokens = linear_tokens(model, (6, 3, 16, 16))
    assert tokens["blocks.0.mlp.fc1"] == tokens["blocks.1.attn.qkv"] == 6 * (4 + 1)  # 4 patches + class token
    assert tokens["head"] == 6 and len(tokens) == 9
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())
    decisions = {d.name: d for d in eligibility(model, "tensorwise", 0, tokens, ShapeRule("tensorwise"))}
    assert decisions["blocks.0.mlp.fc1"].tokens == 30 and not decisions["blocks.0.mlp.fc1"].converted
    assert decisions["head"].reason.startswith("in 64 / out 10 not divisible by 16")


class Wide(nn.Module):
    """Two layers where FP8 pays at a large batch (8192 x 8192) around one that never does (64 wide)."""

    def __init__(self):
        super().__init__()
        with torch.device("meta"):  # shapes only: nothing is allocated or run
            self.up, self.narrow, self.down = nn.Linear(8192, 8192), nn.Linear(8192, 64), nn.Linear(64, 8192)

    def forward(self, x):
        return self.down(self.narrow(self.up(x.flatten(1))))


def test_apply_precision_chooses_by_shape_at_the_training_batch_and_reports_each_layer():
    cfg = PrecisionConfig(precision="fp8", fp8_emulate=True)
    report = apply_precision(Wide(), cfg, torch.device("cpu"), example_shape=(8192, 2, 64, 64)).report["fp8"]
    layers = {d["name"]: d for d in report["layers"]}
    assert layers["up"]["converted"] and layers["up"]["tokens"] == 8192 and layers["up"]["speedup"] > 1.3
    assert not layers["narrow"]["converted"]
    assert "too small for FP8 to pay: roofline ceiling" in layers["narrow"]["reason"]
    assert report["converted"] == 1 and "roofline ceiling >= 1.3x" in report["size_rule"]
    assert "batch of (8192, 2, 64, 64)" in report["size_rule"]
    few = apply_precision(Wide(), cfg, torch.device("cpu"), example_shape=(16, 2, 64, 64)).report["fp8"]
    assert few["converted"] == 0  # 16 rows: no layer pays
    by_size = apply_precision(Wide(), PrecisionConfig(precision="fp8", fp8_emulate=True, fp8_min_dim=4096),
                              torch.device("cpu"), example_shape=(16, 2, 64, 64)).report["fp8"]
    assert by_size["converted"] == 3 and by_size["size_rule"] == "max(in, out) >= --fp8-min-dim 4096"
    unknown = apply_precision(Wide(), cfg, torch.device("cpu")).report["fp8"]
    assert "torchao's size rule" in unknown["size_rule"] and "not known" in unknown["size_rule"]


def test_a_table_that_cannot_apply_is_refused_before_any_data(tmp_path) -> None:
    from torchcls.config import PrecisionConfig
    from torchcls.precision.training import check_precision_options

    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="applies only with --precision fp8 and without --fp8-min-dim"):
        check_precision_options(PrecisionConfig(precision="bf16", fp8_table=str(tmp_path / "bad.json")), "none")
    with pytest.raises(UserError, match="applies only with --precision fp8"):
        check_precision_options(PrecisionConfig(precision="fp8", fp8_min_dim=64, fp8_table="t.json"), "none")
    with pytest.raises(UserError, match="not a table written by"):
        check_precision_options(PrecisionConfig(precision="fp8", fp8_table=str(tmp_path / "bad.json")), "none")

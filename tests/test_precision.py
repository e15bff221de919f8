"""Precision: bf16/fp8-emulated training against fp32, the FP8 layer report, clear errors, the NaN/Inf
guard, and int8 inference parity. Everything runs on CPU (FP8 through torchao's emulation)."""

import json
import math

import pytest
import torch
from torch import nn

from conftest import tiny_config
from torchcls.cli import main
from torchcls.config import TrainConfig
from torchcls.errors import UserError
from torchcls.precision.fp8_layers import eligibility
from torchcls.precision.inference import apply_inference_precision, quantize_for_inference
from torchcls.training import train
from torchcls.checkpoint.files import load_model
from torchcls.precision.training import NonFiniteLoss, apply_precision

CPU = torch.device("cpu")


def tiny_vit() -> nn.Module:
    """A ViT whose Linear layers fall on both sides of the FP8 rule with --fp8-min-dim 128:
    qkv 64->192 and fc1/fc2 64<->192 are eligible, proj 64->64 is too small, head 64->10 does not divide by 16."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_ratio=3,
                             num_classes=10)


def fit(model: nn.Module, cfg: TrainConfig, steps: int = 6) -> list[float]:
    """A few optimizer steps on one fixed batch through the plan apply_precision returns."""
    plan = apply_precision(model, cfg, CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
    losses = []
    for step in range(1, steps + 1):
        with plan.autocast():
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        assert plan.backward_step(loss, opt, model, 1.0, step)
        losses.append(loss.item())
    return losses


def test_bf16_training_reduces_loss_like_fp32():
    reference = fit(tiny_vit(), TrainConfig(precision="fp32"))
    losses = fit(tiny_vit(), TrainConfig(precision="bf16"))
    assert losses[-1] < losses[0] - 0.3
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.05 * reference[0]


def test_fp8_emulated_converts_exactly_the_eligible_layers_and_tracks_fp32():
    cfg = TrainConfig(precision="fp8", fp8_emulate=True, fp8_min_dim=128)
    model = tiny_vit()
    reference = fit(tiny_vit(), TrainConfig(precision="fp32"))
    losses = fit(model, cfg)
    eligible = {f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "mlp.fc1", "mlp.fc2")}
    assert {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"} == eligible
    report = apply_precision(tiny_vit(), cfg, CPU).report["fp8"]
    layers = {d["name"]: d for d in report["layers"]}
    assert {n for n, d in layers.items() if d["converted"]} == eligible
    assert report["converted"] == 6 and report["linear_layers"] == 9 and report["emulate"]
    assert "too small" in layers["blocks.0.attn.proj"]["reason"]
    assert "not divisible by 16" in layers["head"]["reason"]
    assert layers["patch_embed.proj"]["type"] == "Conv2d" and "only nn.Linear" in layers["patch_embed.proj"]["reason"]
    assert losses[-1] < losses[0] - 0.3  # it learns
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.05 * reference[0]  # and tracks fp32


def test_fp8_rowwise_emulated_steps_and_cnn_layers_are_reported_not_converted():
    model = tiny_vit()
    losses = fit(model, TrainConfig(precision="fp8", fp8_emulate=True, fp8_recipe="rowwise", fp8_min_dim=128), 2)
    assert all(math.isfinite(v) for v in losses)
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 6
    from torchcls.models.smallnet import SmallNet

    report = apply_precision(SmallNet(10, 1), TrainConfig(precision="fp8", fp8_emulate=True), CPU).report["fp8"]
    convs = [d for d in report["layers"] if d["type"] == "Conv2d"]
    assert convs and not any(d["converted"] for d in convs) and report["converted"] == 0


def test_fp8_fsdp_all_gather_refuses_a_model_with_no_fp8_layer():
    from torchcls.models.smallnet import SmallNet

    cfg = TrainConfig(precision="fp8", fp8_emulate=True, parallel="fsdp2", fp8_fsdp_all_gather=True)
    with pytest.raises(UserError, match="no layer that FP8 converts.*torchao.s size rule.*lower --fp8-min-dim"):
        apply_precision(SmallNet(10, 1), cfg, CPU)


def test_default_size_rule_agrees_with_torchaos_filter():
    from torchao.float8 import _auto_filter_for_recipe

    shapes = [(n, k) for n in (64, 1000, 1024, 2048, 3072, 4096, 8192) for k in (768, 1024, 2048, 4096, 5120)]
    for recipe in ("tensorwise", "rowwise"):
        theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for n, k in shapes:
            layer = nn.Linear(k, n, device="meta")
            ours = eligibility(nn.Sequential(layer), recipe, min_dim=0)[0].converted
            assert ours == theirs(layer, "0"), (recipe, n, k)


def test_fp8_emulated_train_run_records_report_and_portable_checkpoint(tmp_path, shapes_dir):
    cfg = tiny_config(shapes_dir, tmp_path, "fp8", epochs=1)
    cfg.model.name, cfg.data.img_size = "test_vit", 32
    cfg.train.precision, cfg.train.fp8_emulate, cfg.train.fp8_min_dim = "fp8", True, 128
    result = train(cfg)
    recorded = json.loads((result.run_dir / "precision.json").read_text())
    fp8 = recorded["fp8"]
    assert fp8["backend"] == "torchao" and fp8["recipe"] == "tensorwise" and fp8["emulate"]
    converted = sorted(d["name"] for d in fp8["layers"] if d["converted"])
    assert converted == sorted(f"blocks.{i}.{n}" for i in range(6) for n in ("attn.qkv", "mlp.fc1", "mlp.fc2"))
    html = (result.run_dir / "report.html").read_text()
    assert "blocks.5.mlp.fc2" in html and "stays high precision" in html
    model, _ = load_model(result.best_checkpoint)  # FP8 training leaves a plain fp32 checkpoint
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("flags, message", [
    (["--precision", "fp16"], "--precision fp16 needs a CUDA GPU"),
    (["--precision", "fp8"], "compute capability >= 8.9"),
    (["--precision", "fp8"], "add --fp8-emulate"),
    (["--precision", "bf16", "--fp8-emulate"], "--fp8-emulate applies only with --precision fp8"),
    (["--precision", "fp8", "--fp8-backend", "te"], "TransformerEngine is not installed"),
    (["--precision", "fp8", "--fp8-backend", "te"], "pip install 'transformer-engine[pytorch]'"),
    (["--precision", "fp8", "--fp8-backend", "te", "--fp8-emulate"], "only for --fp8-backend torchao"),
    (["--precision", "bf16", "--fp8-fsdp-all-gather"], "--fp8-fsdp-all-gather needs --precision fp8; --parallel"),
    (["--precision", "fp8", "--fp8-emulate", "--fp8-fsdp-all-gather"], "needs --parallel fsdp2 (under torchrun)"),
    (["--precision", "fp8", "--fp8-emulate", "--fp8-recipe", "rowwise", "--fp8-fsdp-all-gather"],
     "--fp8-recipe tensorwise (torchao all-gathers FP8 weights with one scale per tensor only)"),
    (["--precision", "fp8", "--fp8-backend", "te", "--fp8-fsdp-all-gather"], "--fp8-backend torchao"),
])
def test_misuse_gives_clear_errors(tmp_path, shapes_dir, capsys, flags, message):
    pytest.importorskip("torchao")
    if "te" in flags and _te_importable():
        pytest.skip("TransformerEngine is installed here")
    code = main(["train", "--data", str(shapes_dir), "--out-dir", str(tmp_path), "--name", "x", "--workers", "0",
                 "--device", "cpu", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def test_nonfinite_skip_mode_skips_without_touching_weights():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    plan = apply_precision(model, TrainConfig(precision="bf16", nonfinite="skip"), CPU)
    records = []
    plan.log = records.append
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    y = torch.tensor([0, 1])
    x_nan = torch.full((2, 12), float("nan"))
    with plan.autocast():
        loss = nn.functional.cross_entropy(model(x_nan).float(), y)
    assert plan.backward_step(loss, opt, model, 1.0, step=1) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert records == [{"kind": "nonfinite", "step": 1, "what": "loss", "value": "nan", "action": "skipped"}]
    with plan.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(2, 12)).float(), y)
    assert plan.backward_step(loss, opt, model, 1.0, step=2) is True
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(NonFiniteLoss, match="10 steps in a row"):
        for step in range(3, 20):
            plan.backward_step(torch.tensor(float("inf")), opt, model, 1.0, step)


def test_nonfinite_stop_mode_saves_a_checkpoint_and_says_why(tmp_path, shapes_dir):
    cfg = tiny_config(shapes_dir, tmp_path, "blowup", epochs=2)
    cfg.optim.optimizer, cfg.optim.lr, cfg.optim.warmup_epochs = "sgd", 1e30, 0.0  # step 1 blows the weights up
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss \(nan\) at step 2 .*--nonfinite skip") as e:
        train(cfg)
    assert isinstance(e.value, UserError) and "saved the last good state" in str(e.value)
    state = torch.load(tmp_path / "blowup" / "checkpoints" / "last.state.pt", weights_only=True)
    assert state["step"] == 1  # the failed step was not applied
    assert (tmp_path / "blowup" / "checkpoints" / "last.safetensors").is_file()


def test_int8_inference_parity_within_its_bound(shapes_dir):
    import numpy as np
    from PIL import Image

    files = sorted(shapes_dir.rglob("*.png"))
    x = torch.stack([torch.from_numpy(np.asarray(Image.open(f).convert("RGB").resize((16, 16)), dtype=np.float32)
                                      / 255.0).permute(2, 0, 1) for f in files])
    y = torch.tensor([int(f.parent.name == "square") for f in files])
    model = tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(15):  # trained briefly: top-1 agreement is only meaningful where logits are not tied
        opt.zero_grad()
        nn.functional.cross_entropy(model(x)[:, :2], y).backward()
        opt.step()
    model.eval()
    quantized, report = quantize_for_inference(model, "int8", [x[:16], x[16:]])
    parity = report["parity"]
    assert parity["passed"] and parity["n"] == len(files) == 32
    assert parity["max_rel_logit_diff"] <= 0.05 and parity["top1_agreement"] >= 0.95
    assert 0 < parity["max_abs_logit_diff"]  # it really is quantized
    linear = [d for d in report["layers"] if d["type"] == "Linear"]
    assert all(d["quantized"] and d["weight"] == "Int8Tensor" for d in linear) and len(linear) == 9
    assert not any(d["quantized"] for d in report["layers"] if d["type"] == "Conv2d")
    with pytest.raises(UserError, match="failed parity"):
        quantize_for_inference(model, "int8", x, bounds=(1e-9, 1.0))
    with pytest.raises(UserError, match="compute capability >= 8.9"):
        apply_inference_precision(model, "fp8", "cpu")


def test_grad_scaler_path_steps_and_its_state_is_checkpointed():
    """The fp16 path (scale, unscale before clipping, step, update) on CPU's GradScaler; on a GPU it is 'cuda'."""
    from torchcls.precision.training import PrecisionPlan

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    plan = PrecisionPlan("fp16", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    loss = nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
    assert plan.backward_step(loss, opt, model, grad_clip=1e-3, step=1)
    assert (model.weight - before).abs().max().item() <= 0.1 * 1e-3 + 1e-7  # clipped after unscaling
    assert plan.state_dict()["scaler"]["scale"] == 1024.0
    other = PrecisionPlan("fp16", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    other.load_state_dict(plan.state_dict())
    assert other.scaler.get_scale() == 1024.0

"""Precision: bf16/fp8-emulated training against fp32, the FP8 layer report, clear errors, the NaN/Inf
guard, int8 inference parity, the one bf16 inference wrapper and the one parity function.
Everything runs on CPU (FP8 through torchao's emulation)."""

import ast
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import tiny_config
from torchcls.artifacts.parity import compare
from torchcls.artifacts.quantize import quantize_for_inference
from torchcls.checkpoint.files import load_model, load_training_state
from torchcls.cli import main
from torchcls.config import PrecisionConfig
from torchcls.errors import UserError
from torchcls.precision.dtypes import DTYPES
from torchcls.precision.fp8_layers import eligibility
from torchcls.precision.hardware import cpu_int8_matmul_exact
from torchcls.precision.inference import CastIO, apply_inference_precision
from torchcls.precision.training import NonFiniteLoss, apply_precision, fp8_wants_compile
from torchcls.training import train

CPU = torch.device("cpu")


def tiny_vit() -> nn.Module:
    """A ViT whose Linear layers fall on both sides of the FP8 rule with --fp8-min-dim 128:
    qkv 64->192 and fc1/fc2 64<->192 are eligible, proj 64->64 is too small, head 64->10 does not divide by 16."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_ratio=3,
                             num_classes=10)


def fit(model: nn.Module, cfg: PrecisionConfig, steps: int = 6) -> list[float]:
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
    reference = fit(tiny_vit(), PrecisionConfig(precision="fp32"))
    losses = fit(tiny_vit(), PrecisionConfig(precision="bf16"))
    assert losses[-1] < losses[0] - 0.3
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.05 * reference[0]


def test_fp8_emulated_converts_exactly_the_eligible_layers_and_tracks_fp32():
    cfg = PrecisionConfig(precision="fp8", fp8_emulate=True, fp8_min_dim=128)
    model = tiny_vit()
    reference = fit(tiny_vit(), PrecisionConfig(precision="fp32"))
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
    losses = fit(model, PrecisionConfig(precision="fp8", fp8_emulate=True, fp8_recipe="rowwise", fp8_min_dim=128), 2)
    assert all(math.isfinite(v) for v in losses)
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 6
    from torchcls.models.smallnet import SmallNet

    report = apply_precision(SmallNet(10, 1), PrecisionConfig(precision="fp8", fp8_emulate=True), CPU).report["fp8"]
    convs = [d for d in report["layers"] if d["type"] == "Conv2d"]
    assert convs and not any(d["converted"] for d in convs) and report["converted"] == 0


def test_fp8_fsdp_all_gather_refuses_a_model_with_no_fp8_layer():
    from torchcls.models.smallnet import SmallNet

    cfg = PrecisionConfig(precision="fp8", fp8_emulate=True, fp8_fsdp_all_gather=True)
    with pytest.raises(UserError, match="no layer that FP8 converts.*torchao.s size rule.*lower --fp8-min-dim"):
        apply_precision(SmallNet(10, 1), cfg, CPU, parallel="fsdp2")
    with pytest.raises(UserError, match="needs --parallel fsdp2"):  # the parallel mode is a parameter
        apply_precision(SmallNet(10, 1), cfg, CPU, parallel="ddp")


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
    cfg.precision.precision, cfg.precision.fp8_emulate, cfg.precision.fp8_min_dim = "fp8", True, 128
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
    plan = apply_precision(model, PrecisionConfig(precision="bf16", nonfinite="skip"), CPU)
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
    state = load_training_state(tmp_path / "blowup" / "checkpoints" / "last.state.safetensors")
    assert state["step"] == 1  # the failed step was not applied
    assert (tmp_path / "blowup" / "checkpoints" / "last.safetensors").is_file()


def test_a_deferred_check_stops_a_run_with_its_last_good_weights(tmp_path, shapes_dir):
    cfg = tiny_config(shapes_dir, tmp_path, "deferred", epochs=2)
    cfg.optim.optimizer, cfg.optim.lr, cfg.optim.warmup_epochs = "sgd", 1e30, 0.0  # step 1 blows the weights up
    cfg.precision.nonfinite_check, cfg.train.log_every = "deferred", 1
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss or gradient norm \(1 step\(s\) not applied\) .* at "
                                            r"step 2"):
        train(cfg)
    state = load_training_state(tmp_path / "deferred" / "checkpoints" / "last.state.safetensors")
    assert state["step"] == 2  # the skipped step is counted, its update was not applied:
    assert all(torch.isfinite(v).all() for k, v in state["model"].items() if "running" not in k)  # (BatchNorm
    # statistics took the non-finite forward, with either check)


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
    if not cpu_int8_matmul_exact():  # oneDNN without VNNI (an AVX2 machine): refused before any wrong output
        with pytest.raises(UserError, match="saturates"):
            quantize_for_inference(model, "int8", [x[:16], x[16:]])
        return
    quantized, report = quantize_for_inference(model, "int8", [x[:16], x[16:]])
    parity = report["parity"]
    assert parity["passed"] and parity["n"] == len(files) == 32
    assert parity["max_rel_logit_diff"] <= 0.05 and parity["top1_agreement"] >= 0.95
    assert 0 < parity["max_abs_diff"] == parity["max_abs_logit_diff"]  # it really is quantized
    with torch.no_grad():  # the figures are parity.compare's on the same inputs
        expected = compare(model(x), quantized(x))
    assert {k: parity[k] for k in expected} == pytest.approx(expected)
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


def test_compare_is_the_one_parity_function_and_its_keys():
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0], [1.0, 0.0, 0.0], [0.0, 2.0, 1.0]])
    cand = ref.clone()
    cand[3] = torch.tensor([0.0, 1.0, 1.5])  # the last row's top-1 flips from class 1 to class 2
    r = compare(ref, cand.to(torch.bfloat16))
    assert set(r) == {"max_abs_diff", "mean_abs_diff", "top1_agreement", "n"}
    assert r["n"] == 4 and r["top1_agreement"] == 0.75
    assert r["max_abs_diff"] == 1.0 and r["mean_abs_diff"] == pytest.approx(1.5 / 12)
    r = compare(ref, cand, labels=torch.tensor([0, 2, 0, 2]))
    assert r["eager_accuracy"] == 0.75 and r["artifact_accuracy"] == 1.0
    with pytest.raises(UserError, match="two \\(N, classes\\) logit tensors"):
        compare(ref, ref[:2])


def test_castio_is_fp32_in_fp32_out_with_weights_in_its_dtype():
    from torchcls.models.smallnet import SmallNet

    torch.manual_seed(0)
    model = SmallNet(10, 1).train()
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        reference = model.eval()(x)
    wrapped = CastIO(model, DTYPES["bf16"])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # cast in place, as documented
    assert not wrapped.training and wrapped.dtype == torch.bfloat16
    with torch.no_grad():
        out = wrapped(x)
    assert out.dtype == torch.float32 and out.shape == reference.shape
    parity = compare(reference, out)
    assert 0 < parity["max_abs_diff"] < 0.1 * reference.abs().max().item() and parity["top1_agreement"] >= 0.75
    assert CastIO(model, "bf16").dtype == torch.bfloat16  # a precision name works too


def test_precision_plan_reports_compile_but_does_not_decide_it():
    cfg = PrecisionConfig(precision="fp8", fp8_emulate=True)
    assert not fp8_wants_compile(cfg)  # emulation: a numerics check, compile would not pay
    assert fp8_wants_compile(PrecisionConfig(precision="fp8")) and not fp8_wants_compile(
        PrecisionConfig(precision="fp8", fp8_compile=False))
    plan = apply_precision(nn.Linear(4, 2), PrecisionConfig(precision="bf16"), CPU, compile=False)
    assert plan.compile is False and plan.report["compile"] is False
    plan = apply_precision(nn.Linear(4, 2), PrecisionConfig(precision="bf16"), CPU, compile=True,
                           compile_note="because the caller says so")
    assert plan.report["compile"] is True and plan.report["compile_note"] == "because the caller says so"


def test_precision_package_never_imports_artifacts():
    root = Path(__file__).resolve().parents[1] / "src" / "torchcls" / "precision"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("torchcls.artifacts") for n in names), path.name


@pytest.mark.slow
def test_compile_for_inference_bf16_uses_castio_and_keeps_the_model_fp32():
    from torchcls.artifacts.compiled_classifier import compile_for_inference
    from torchcls.models.smallnet import SmallNet

    torch.manual_seed(0)
    model = SmallNet(10, 1).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        reference = model(x)
    runner = compile_for_inference(model, x, "cpu", "bf16", max_batch=4, buckets=(4,))
    out = runner(x)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the caller's model stays fp32
    assert out.dtype == torch.float32 and out.shape == (3, 10)
    assert compare(reference, out)["max_abs_diff"] < 0.1 * reference.abs().max().item()


def test_heldout_batches_feed_quantize_for_inference_on_a_real_run(trained_run):
    """The documented flow: held-out images of a run (the ones export's parity uses), then bf16 with parity."""
    from torchcls.artifacts.parity import held_out_images
    from torchcls.artifacts.quantize import heldout_batches
    from torchcls.checkpoint.files import read_meta, resolve_checkpoint

    batches = heldout_batches(str(trained_run), n=20, batch_size=8)
    assert [tuple(b.shape) for b in batches] == [(8, 3, 32, 32), (8, 3, 32, 32), (4, 3, 32, 32)]
    images, _ = held_out_images(read_meta(resolve_checkpoint(trained_run)), 20)
    assert torch.equal(torch.cat(batches), images)
    model, _ = load_model(resolve_checkpoint(trained_run))
    converted, report = quantize_for_inference(model, "bf16", batches)
    assert report["parity"]["passed"] and report["parity"]["n"] == 20 and report["precision"] == "bf16"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the caller's model is not touched
    assert isinstance(converted, CastIO) and converted(batches[0]).dtype == torch.float32


def test_deferred_nonfinite_check_skips_on_the_device_and_reports_at_the_next_read():
    """With a fused optimizer the NaN/Inf decision stays on the device (no host sync per step): the update
    is skipped by the optimizer's found_inf flag, and `check` reports it as the per-step check would."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    plan = apply_precision(model, PrecisionConfig(precision="fp32", nonfinite="skip"), CPU)
    records = []
    plan.log = records.append
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    assert plan.defer_checks(opt) and not plan.check_each_step
    y = torch.tensor([0, 1])
    before = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.cross_entropy(model(torch.full((2, 12), float("nan"))), y)
    ok = plan.backward_step(loss, opt, model, 1.0, step=1)
    assert torch.is_tensor(ok) and not ok.item()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # not applied
    assert records == []  # nothing read yet
    opt.zero_grad()  # as the trainer does after every step
    ok = plan.backward_step(nn.functional.cross_entropy(model(torch.randn(2, 12)), y), opt, model, 1.0, step=2)
    assert ok.item() and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    plan.check()
    assert records == [{"kind": "nonfinite", "step": 1, "what": "loss or gradient norm (1 step(s) not applied)",
                        "value": "nan", "action": "skipped"}]
    plan.check()  # read once
    assert len(records) == 1
    plan.nonfinite = "stop"
    opt.zero_grad()
    plan.backward_step(nn.functional.cross_entropy(model(torch.full((2, 12), float("inf"))), y), opt, model, 1.0, 3)
    with pytest.raises(NonFiniteLoss, match=r"at step 3"):
        plan.check()
    assert not plan.defer_checks(torch.optim.SGD(model.parameters(), lr=0.1))  # unfused: checked each step


@pytest.mark.parametrize("images", [5, 16, 40])
def test_parity_runs_the_first_images_one_at_a_time_then_chunks(images):
    """Every image is compared once: the first 16 alone (an artifact's batch-1 path), the rest in chunks of the
    artifact's bound that end with a partial one."""
    from types import SimpleNamespace

    from torchcls.artifacts.parity import SINGLE_IMAGES, measure_parity

    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)).eval()
    batches = []

    def artifact(x):
        batches.append(len(x))
        return model(x)

    artifact.info = SimpleNamespace(max_batch=8)  # type: ignore[attr-defined]
    x = torch.randn(images, 3, 2, 2)
    result = measure_parity(model, artifact, x, torch.zeros(images, dtype=torch.long), 0.999)
    singles = min(SINGLE_IMAGES, images)
    rest = images - singles
    assert batches[:singles] == [1] * singles and sum(batches) == result["n"] == images
    assert batches[singles:] == [8] * (rest // 8) + ([rest % 8] if rest % 8 else [])
    assert result["batch1_images"] == singles and result["passed"] and result["max_abs_diff"] == 0

"""GPU precision check (H100/H200/B200): bf16 vs FP8 (torchao tensorwise, rowwise) training step time
and loss parity on a ViT large enough for FP8 to pay, and FP8 inference latency. One run, < 8 minutes,
prints JSON. Refuses clearly (exit 2) without a CUDA GPU of compute capability >= 8.9.

Training goes through torchcls's own `apply_precision` (the function `torchcls train` uses), so the
FP8 layer selection and report are the ones a run gets; each transformer block is torch.compiled
separately (identical blocks share one compiled graph: seconds instead of minutes, as torchtitan does).
All variants start from the same weights and see the same batches; loss parity is the max |Δloss|
against bf16 over the timed steps. Inference: `apply_inference_precision` bf16 vs fp8, compiled,
with parity against the fp32 eager model (torchcls.artifacts.parity.compare).

    python benchmarks/gpu/precision.py                       # ViT-H/14, batch 32, 224 px
    python benchmarks/gpu/precision.py --model vit_large_patch16_224 --fp8-min-dim 1024
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
from torch import nn

T0 = time.perf_counter()


def refuse(message: str) -> None:
    print(json.dumps({"benchmark": "precision-gpu", "error": message}), flush=True)
    print(f"benchmarks/gpu/precision.py: {message}", file=sys.stderr)
    sys.exit(2)


def check_gpu() -> dict:
    if not torch.cuda.is_available():
        refuse("needs a CUDA GPU with compute capability >= 8.9 (H100/H200/B200, L40, RTX 40xx); this machine "
               "has none. Nothing was measured. Run it on a GPU machine.")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        refuse(f"{torch.cuda.get_device_name()} has compute capability {cap[0]}.{cap[1]}; FP8 tensor cores need "
               ">= 8.9 (H100/H200/B200, L40, RTX 40xx). Nothing was measured.")
    try:
        import timm  # noqa: F401
        import torchao  # noqa: F401
    except ImportError as e:
        refuse(f"needs torchao and timm ({e}); pip install -e '.[precision]'")
    return {"gpu": torch.cuda.get_device_name(), "capability": f"{cap[0]}.{cap[1]}", "torch": torch.__version__}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def compile_blocks(model: nn.Module) -> None:
    for block in getattr(model, "blocks", []):
        block.compile()


def build(args) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model(args.model, pretrained=False, num_classes=1000, img_size=args.img_size).cuda()


def cuda_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def train_variant(name: str, base: nn.Module, batches, args) -> dict:
    from torchcls.config import PrecisionConfig
    from torchcls.precision.training import apply_precision

    precision, _, recipe = name.partition("-")
    model = copy.deepcopy(base).train()
    cfg = PrecisionConfig(precision=precision, fp8_recipe=recipe or "tensorwise", fp8_min_dim=args.fp8_min_dim)
    plan = apply_precision(model, cfg, torch.device("cuda"), compile=True, compile_note="per transformer block")
    compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    losses, times = [], []

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with plan.autocast():
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        plan.backward_step(loss, opt, model, 1.0, i + 1)
        losses.append(loss.item())

    t = time.perf_counter()
    step(0)  # compile
    compile_s = time.perf_counter() - t
    for i in range(1, args.warmup):
        step(i)
    for i in range(args.warmup, args.warmup + args.steps):
        times.append(cuda_ms(lambda: step(i)))
    fp8 = plan.report.get("fp8") or {}
    out = {"variant": name, "step_ms": statistics.median(times), "img_per_s": args.batch_size / statistics.median(times) * 1e3,
           "compile_s": compile_s, "losses": losses, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
           "fp8_converted": fp8.get("converted"), "linear_layers": fp8.get("linear_layers")}
    model = opt = None  # release them before the next variant (step() still refers to these names)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def inference_variant(name: str, base: nn.Module, x, reference_logits, args) -> dict:
    from torchcls.artifacts.parity import compare
    from torchcls.precision.inference import apply_inference_precision

    precision, _, recipe = name.partition("-")
    result = apply_inference_precision(base, precision, "cuda", fp8_recipe=recipe or "tensorwise")
    model = result.model
    compile_blocks(getattr(model, "inner", model))
    with torch.no_grad():
        t = time.perf_counter()
        model(x)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t
        for _ in range(args.warmup):
            model(x)
        times = [cuda_ms(lambda: model(x)) for _ in range(args.steps)]
        parity = compare(reference_logits, model(x))
    return {"variant": name, "latency_ms": statistics.median(times), "compile_s": compile_s,
            "quantized_layers": sum(entry["quantized"] for entry in result.layers),
            "max_abs_logit_diff": parity["max_abs_diff"], "top1_agreement": parity["top1_agreement"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_huge_patch14_224", help="a timm ViT (ViT-H: MLP 1280->5120)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--fp8-min-dim", type=int, default=0, help="0 = torchao's per-recipe size thresholds")
    p.add_argument("--budget-s", type=float, default=420, help="skip remaining variants past this")
    args = p.parse_args()
    env = check_gpu()
    torch.backends.cuda.matmul.allow_tf32 = True
    base = build(args)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [(torch.randn(args.batch_size, 3, args.img_size, args.img_size, device="cuda", generator=g),
                torch.randint(0, 1000, (args.batch_size,), device="cuda", generator=g)) for _ in range(4)]
    result = {"benchmark": "precision-gpu", **env, "model": args.model, "batch_size": args.batch_size,
              "img_size": args.img_size, "steps": args.steps, "train": [], "inference": [], "skipped": []}
    for name in ("bf16", "fp8-tensorwise", "fp8-rowwise"):
        if time.perf_counter() - T0 > args.budget_s:
            result["skipped"].append(f"train {name}: time budget")
            continue
        log(f"train {name}")
        result["train"].append(train_variant(name, base, batches, args))
    ref = next((r for r in result["train"] if r["variant"] == "bf16"), None)
    for r in result["train"]:
        if ref is not None:
            r["max_abs_loss_diff_vs_bf16"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
            r["speedup_vs_bf16"] = ref["step_ms"] / r["step_ms"]
    x = batches[0][0]
    with torch.no_grad():
        reference_logits = base.eval()(x).float()  # fp32 eager
    for name in ("bf16", "fp8-tensorwise", "fp8-rowwise"):
        if time.perf_counter() - T0 > args.budget_s:
            result["skipped"].append(f"inference {name}: time budget")
            continue
        log(f"inference {name}")
        result["inference"].append(inference_variant(name, base, x, reference_logits, args))
    ref = next((r for r in result["inference"] if r["variant"] == "bf16"), None)
    for r in result["inference"]:
        if ref is not None:
            r["speedup_vs_bf16"] = ref["latency_ms"] / r["latency_ms"]
    result["wall_s"] = time.perf_counter() - T0
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

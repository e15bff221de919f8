"""CPU precision benchmark: training and inference step time for fp32 vs bf16 (and int8 inference)
on ResNet-18 and a small ViT, in one process.

Training: one optimizer step (forward, backward, fused AdamW) through the same PrecisionPlan that
`torchcls train` uses (fp32, bf16 autocast; channels_last for the CNN), compared fairly: with --compile
(the default) the whole model is compiled in every arm, the NaN/Inf check is the deferred one and the
loss stays a tensor (no scalar read inside a step; on a GPU that would be a host synchronisation per
step), and each figure carries the layers its precision converted (0 here: FP8 is the GPU check's,
benchmarks/gpu/steps.py fp8, with torchcls.suite.timed_steps). Inference: the model
from `torchcls.precision.inference.apply_inference_precision` (fp32, bf16 weights, int8 dynamic),
eager; with --compile also fp32 and int8 under torch.compile + freezing, where int8 pays.
Variants are interleaved per round (A B C A B C ...) because this machine's speed drifts;
figures are medians over rounds. Parity of each inference variant against fp32 eager is reported
with torchcls.artifacts.parity.compare (random-init weights: top-1 agreement is indicative only). Prints JSON, then Markdown.

    python benchmarks/precision.py --rounds 5 --batch-size 8 --img-size 112
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from torchcls.artifacts.parity import compare
from torchcls.config import PrecisionConfig
from torchcls.machine import describe_machine, machine_line
from torchcls.models import ModelSpec, create_model
from torchcls.precision.hardware import cpu_bf16_here, cpu_int8_matmul_exact
from torchcls.precision.inference import apply_inference_precision
from torchcls.precision.training import apply_precision
from torchcls.suite.timed_steps import fused_adamw

CPU = torch.device("cpu")
MODELS = {"resnet18": "tv/resnet18", "vit-tiny": "vit_tiny_patch16_224"}


def build(name: str, args) -> nn.Module:
    torch.manual_seed(0)
    model = create_model(ModelSpec(MODELS[name], 10, 3, args.img_size))
    return model.to(memory_format=torch.channels_last) if name == "resnet18" else model


def train_step_fn(name: str, precision: str, args, x, y):
    model = build(name, args).train()
    plan = apply_precision(model, PrecisionConfig(precision=precision), CPU, compile=args.compile,
                           compile_note="whole model, every arm", example_shape=tuple(x.shape))
    opt = fused_adamw(model, 1e-3)
    plan.defer_checks(opt)  # the NaN/Inf decision stays a tensor: no scalar read per step
    forward = torch.compile(model) if args.compile else model
    step = [0]

    def run() -> float:
        t0 = time.perf_counter()
        with plan.autocast():
            logits = forward(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        step[0] += 1
        plan.backward_step(loss, opt, model, 1.0, step[0])
        return (time.perf_counter() - t0) * 1e3

    run.converted = (plan.report.get("fp8") or {}).get("converted", 0)  # type: ignore[attr-defined]
    return run


def infer_fn(model: nn.Module, x):
    @torch.no_grad()
    def run() -> float:
        t0 = time.perf_counter()
        model(x)
        return (time.perf_counter() - t0) * 1e3

    return run


def measure(fns: dict, rounds: int, warmup: int) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():  # interleaved
            times[k].append(fn())
    return {k: statistics.median(v) for k, v in times.items()}


def bench_model(name: str, args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g)
    if name == "resnet18":
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    rows = []
    steps = {p: train_step_fn(name, p, args, x, y) for p in ("fp32", "bf16")}
    train_ms = measure(steps, args.rounds, 1)
    for p, ms in train_ms.items():
        rows.append({"model": name, "phase": "train", "variant": p, "ms": ms, "speedup_vs_fp32": train_ms["fp32"] / ms,
                     "compiled": args.compile, "converted_layers": steps[p].converted})

    reference = build(name, args).eval()
    int8 = ("int8",) if cpu_int8_matmul_exact() else ()
    precisions = ("fp32", "bf16", *int8)
    if not int8:
        print("# int8 skipped: this CPU's int8 GEMM (oneDNN without VNNI) saturates; its outputs would be wrong",
              flush=True)
    converted = {p: apply_inference_precision(reference, p, CPU) for p in precisions}
    layers = {p: c.summary()["quantized_layers"] for p, c in converted.items()}
    variants = {p: c.model for p, c in converted.items()}
    if args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # without freezing, compiled CPU inference is not faster
        for p in ("fp32", *int8):
            compiled = torch.compile(apply_inference_precision(reference, p, CPU).model)
            with torch.no_grad():
                t0 = time.perf_counter()
                compiled(x)
                print(f"# compiled {name} {p} in {time.perf_counter() - t0:.0f} s", flush=True)
            variants[f"{p}+compile"], layers[f"{p}+compile"] = compiled, layers[p]
    infer_ms = measure({k: infer_fn(m, x) for k, m in variants.items()}, args.rounds, 1)
    for k, ms in infer_ms.items():
        with torch.no_grad():
            parity = compare(reference(x), variants[k](x))
        rows.append({"model": name, "phase": "inference", "variant": k, "ms": ms,
                     "speedup_vs_fp32": infer_ms["fp32"] / ms, "max_abs_logit_diff": parity["max_abs_diff"],
                     "top1_agreement": parity["top1_agreement"], "compiled": k.endswith("+compile"),
                     "converted_layers": layers[k]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18,vit-tiny", help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--img-size", type=int, default=112)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the whole model in every training arm, and also measure fp32 and int8 inference "
                        "under torch.compile (where int8 pays)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="torchcls-bench-") as tmp:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "inductor"))
        rows = [r for name in args.models.split(",") for r in bench_model(name, args)]
    result = {"benchmark": "precision-cpu", "batch_size": args.batch_size, "img_size": args.img_size,
              "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__, "rows": rows}
    native, why = cpu_bf16_here()  # bf16 figures are the emulation's where the CPU lacks it
    result["machine"] = describe_machine("fp32, bf16, int8") | {"bf16_native": native, "bf16_reason": why}
    print(json.dumps(result, indent=2))
    print(f"\nMachine: {machine_line(result['machine'])}" + ("" if native else f" (bf16 emulated: {why})"))
    print("\n| model | phase | variant | ms / step (median) | vs fp32 | converted layers | max abs Δlogit | top-1 agree |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        parity = (f"{r['max_abs_logit_diff']:.3g} | {r['top1_agreement']:.2f}" if "top1_agreement" in r else "- | -")
        print(f"| {r['model']} | {r['phase']} | {r['variant']} | {r['ms']:.1f} | {r['speedup_vs_fp32']:.2f}x | "
              f"{r['converted_layers']} | {parity} |")


if __name__ == "__main__":
    main()

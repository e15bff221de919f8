"""The measurements of the device check (check.py runs each as its own process, with its own timeout):

    env    torch, CUDA, GPU name and compute capability; exit 3 without a usable CUDA GPU
    train  one model's training step, bf16 autocast, eager then torch.compile: images/s (synthetic batches)
    fp8    bf16 vs FP8 tensorwise/rowwise training of a timm backbone (--model, --depth), the whole model
           compiled in every arm, converted-layer counts beside each figure; then bf16 vs FP8 inference,
           both compiled
    infer  a CUDA .pt2 vs eager vs torch.compile of its checkpoint: batch-1 latency, batch-64 throughput

Training goes through torchcls's `apply_precision` (the function `torchcls train` uses), so the FP8 layer
selection and autocast are the ones a run gets, and through torchcls.suite.timed_steps.timed_train_steps: no
host synchronisation inside the timed steps (deferred NaN/Inf check, losses kept as tensors, one CUDA
event pair around them). Every figure is written to the --json file as soon as it is measured: a step
killed by its timeout still leaves what it measured.

`--device cpu` (with small --img-size, --batch, --depth and --fp8-emulate) runs the same code on a CPU: a
smoke test of this script before a GPU is spent on it, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

T0 = time.perf_counter()
DEVICE = torch.device("cuda")


class Record:
    """The step's JSON, rewritten after every figure."""

    def __init__(self, path: str):
        self.path, self.data = Path(path), {}

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self.path.write_text(json.dumps(self.data, indent=2))


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def cuda_ms(fn) -> float:
    """Milliseconds of fn() on the device (CUDA events; wall time on a CPU)."""
    if DEVICE.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def env(args, rec: Record) -> int:
    if args.device == "cpu":  # the rehearsal: the stack the steps will run under, no GPU expected
        import platform

        rec.set(gpu=None, torch=torch.__version__, cuda_build=torch.version.cuda, python=platform.python_version(),
                rehearsal="cpu stand-in")
        return 0
    if not torch.cuda.is_available():
        rec.set(error="no usable CUDA GPU", torch=torch.__version__, cuda_build=torch.version.cuda)
        print(f"steps.py env: needs a CUDA GPU; torch {torch.__version__} (CUDA build {torch.version.cuda}) sees "
              "none", file=sys.stderr)
        return 3
    cap = torch.cuda.get_device_capability()
    free, total = torch.cuda.mem_get_info()
    rec.set(gpu=torch.cuda.get_device_name(), capability=f"{cap[0]}.{cap[1]}", gpus=torch.cuda.device_count(),
            memory_gib=round(total / 2**30, 1), torch=torch.__version__, cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())),
            bf16=torch.cuda.is_bf16_supported(), fp8=cap >= (8, 9))
    return 0


def train(args, rec: Record) -> int:
    """bf16 eager, then bf16 torch.compile of the same weights on the same batches (what --compile does)."""
    import timm

    from torchcls.config import PrecisionConfig
    from torchcls.precision.training import apply_precision
    from torchcls.suite.timed_steps import fused_adamw, timed_train_steps

    torch.manual_seed(0)
    size = args.img_size
    kwargs = {"img_size": size} if "vit" in args.model else {}
    base = timm.create_model(args.model, pretrained=False, num_classes=1000, **kwargs).to(DEVICE).train()
    if "vit" not in args.model:
        base = base.to(memory_format=torch.channels_last)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    batches = [(torch.randn(args.batch, 3, size, size, device=DEVICE, generator=g),
                torch.randint(0, 1000, (args.batch,), device=DEVICE, generator=g)) for _ in range(2)]
    rec.set(model=args.model, batch=args.batch, img_size=size, precision="bf16", device=str(DEVICE))
    for variant in ("eager", "compile"):
        model = copy.deepcopy(base)
        plan = apply_precision(model, PrecisionConfig(precision="bf16"), DEVICE, compile=variant == "compile")
        if variant == "compile":
            model = torch.compile(model)
        log(f"{args.model} {variant}")
        rec.set(**{variant: timed_train_steps(model, plan, fused_adamw(model), batches, args.warmup, args.steps)})
        del model
        release()
    rec.set(compile_speedup=round(rec.data["compile"]["images_per_s"] / rec.data["eager"]["images_per_s"], 3))
    return 0


def fp8(args, rec: Record) -> int:
    """bf16 vs FP8 tensorwise vs rowwise training of one timm backbone (--model, --depth blocks), the whole
    model compiled in every arm, the same weights and batches, no host synchronisation inside the timed
    steps (torchcls.suite.timed_steps); the layers FP8 converts are the ones torchcls's rule chooses at this batch
    (or --fp8-table's), counted next to each figure. Then bf16 vs FP8 inference, both compiled."""
    import timm

    from torchcls.config import PrecisionConfig
    from torchcls.precision.hardware import require_fp8_hardware
    from torchcls.precision.training import apply_precision
    from torchcls.suite.timed_steps import fused_adamw, timed_train_steps

    variants = args.variants.split(",")
    if any(v.startswith("fp8") for v in variants) and not args.fp8_emulate:
        require_fp8_hardware(DEVICE, "the FP8 step", None)
    torch.manual_seed(0)
    size = args.img_size
    depth = {"depth": args.depth} if args.depth else {}  # fewer blocks: the same GEMM shapes, less compile time
    base = timm.create_model(args.model, pretrained=False, num_classes=1000, img_size=size, **depth).to(DEVICE).train()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    batches = [(torch.randn(args.batch, 3, size, size, device=DEVICE, generator=g),
                torch.randint(0, 1000, (args.batch,), device=DEVICE, generator=g)) for _ in range(2)]
    from torchcls.precision.fp8_layers import linear_tokens

    tokens = max(linear_tokens(base, (args.batch, 3, size, size)).values())  # M of the widest GEMMs: the blocks'
    rec.set(model=args.model, depth=args.depth, batch=args.batch, img_size=size, tokens_per_step=tokens,
            compiled="whole model, every arm", fp8_table=args.fp8_table, emulated=args.fp8_emulate, train={})
    for name in variants:
        precision, _, recipe = name.partition("-")
        model = copy.deepcopy(base)
        cfg = PrecisionConfig(precision=precision, fp8_recipe=recipe or "tensorwise", fp8_emulate=args.fp8_emulate
                              and precision == "fp8", fp8_table=args.fp8_table, fp8_min_dim=args.fp8_min_dim)
        plan = apply_precision(model, cfg, DEVICE, compile=True, compile_note="whole model, every arm",
                               example_shape=(args.batch, 3, size, size))
        log(f"train {name}")
        result = timed_train_steps(torch.compile(model), plan, fused_adamw(model), batches, args.warmup, args.steps)
        rec.data["train"][name] = result | _fp8_layers(plan)
        rec.set()
        del model
        release()
    _compare(rec.data["train"], variants[0])
    rec.set()
    fp8_inference(base, batches[0][0], variants, rec, args)
    return 0


def _fp8_layers(plan) -> dict[str, Any]:
    """The converted-layer count and rule beside a figure (and each layer's decision, in the JSON only)."""
    report = (getattr(plan, "report", None) or {}).get("fp8")
    if not report:
        return {"fp8_converted": 0}
    return {"fp8_converted": report["converted"], "linear_layers": report["linear_layers"],
            "fp8_rule": report["size_rule"],
            "fp8_layers": [{k: d[k] for k in ("name", "in_features", "out_features", "tokens", "converted",
                                              "speedup", "reason")} for d in report["layers"]]}


def _compare(train: dict[str, dict[str, Any]], reference: str) -> None:
    ref = train[reference]
    for r in train.values():
        r["speedup_vs_bf16"] = round(ref["step_ms"] / r["step_ms"], 3)
        r["max_abs_loss_diff_vs_bf16"] = round(max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])), 5)


def fp8_inference(base: nn.Module, x: torch.Tensor, variants: list[str], rec: Record, args) -> None:
    """bf16 and FP8 inference of the same weights, each compiled (torchao publishes FP8 inference gains
    under torch.compile only), latency of one batch; parity against the bf16 model."""
    from torchcls.artifacts.parity import compare
    from torchcls.precision.inference import apply_inference_precision

    rec.data["inference"] = {}
    reference = None
    for name in variants:
        precision, _, recipe = name.partition("-")
        if precision == "fp8" and args.fp8_emulate:
            continue  # torchao's FP8 inference has no emulation: a GPU of compute capability >= 8.9 only
        converted = apply_inference_precision(base, precision, DEVICE, fp8_recipe=recipe or "tensorwise")
        model = torch.compile(converted.model)
        with torch.no_grad():
            out = model(x).float()
            ms = statistics.median(cuda_ms(lambda m=model: m(x)) for _ in range(10))
        reference = out if reference is None else reference
        rec.data["inference"][name] = {"latency_ms": round(ms, 3), "compiled": True,
                                       "quantized_layers": converted.summary()["quantized_layers"],
                                       **{k: v for k, v in compare(reference, out).items()
                                          if k in ("top1_agreement", "max_abs_diff")}}
        rec.set()
        release()


def release() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench(fn, x: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of fn(x) (x on the host: the host-to-device copy is part of serving)."""
    for _ in range(3):
        fn(x)
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def infer(args, rec: Record) -> int:
    """The CUDA .pt2 (loaded with auto = its build device), eager fp32 and torch.compile (the compile policy
    with mode=default) of the same checkpoint, each called with host batches and returning host logits."""
    from torchcls.artifacts import compile_for_inference, load_artifact
    from torchcls.checkpoint.files import load_model

    artifact = load_artifact(args.artifact)
    rec.set(artifact_device=str(artifact.device), info_device=artifact.info.device,
            compute_capability=artifact.info.compute_capability)
    pre = artifact.info.preprocess
    shape = (pre.channels, pre.img_size, pre.img_size)
    model, _ = load_model(args.checkpoint)
    model = model.to(DEVICE).eval()

    @torch.no_grad()
    def eager(x: torch.Tensor) -> torch.Tensor:
        return model(x.to(DEVICE, non_blocking=True)).float().cpu()

    sides: dict[str, Any] = {"aoti": artifact, "eager": eager}
    for name in ("aoti", "eager", "compile"):
        if name == "compile":
            sides[name] = compile_for_inference(copy.deepcopy(model), torch.zeros(1, *shape), DEVICE,
                                                max_batch=args.big, buckets=(1, args.big), mode="default")
        b1 = bench(sides[name], torch.randn(1, *shape), args.repeats)
        big = bench(sides[name], torch.randn(args.big, *shape), args.repeats)
        rec.set(**{name: {"b1_ms": round(b1, 3), "b64_ms": round(big, 2), "b64_images_per_s": round(args.big * 1e3 / big, 1),
                          "big_batch": args.big}})
    for name in ("aoti", "compile"):
        rec.data[name]["b1_speedup_vs_eager"] = round(rec.data["eager"]["b1_ms"] / rec.data[name]["b1_ms"], 3)
        rec.data[name]["b64_speedup_vs_eager"] = round(rec.data["eager"]["b64_ms"] / rec.data[name]["b64_ms"], 3)
    rec.set()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("env", "train", "fp8", "infer"))
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20, help="timed inference calls")
    p.add_argument("--img-size", type=int, default=224, help="train: input size")
    p.add_argument("--variants", default="bf16,fp8-tensorwise,fp8-rowwise", help="fp8: what to compare (bf16 first)")
    p.add_argument("--artifact")
    p.add_argument("--checkpoint")
    p.add_argument("--big", type=int, default=64, help="infer: the large batch")
    p.add_argument("--depth", type=int, help="fp8: the backbone's blocks (default: timm's); each block has the "
                   "full width, so the GEMM shapes are the backbone's")
    p.add_argument("--fp8-table", help="fp8: a table of fp8_gemm.py for torchcls's layer rule (--fp8-table)")
    p.add_argument("--fp8-emulate", action="store_true", help="fp8: torchao's emulation (the CPU stand-in)")
    p.add_argument("--fp8-min-dim", type=int, default=0, help="fp8: torchcls's --fp8-min-dim (0: the shape rule); "
                   "the CPU stand-in sets it, as its tiny shapes never pay")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    args = p.parse_args()
    rec = Record(args.json)
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.step != "env" and DEVICE.type == "cuda" and not torch.cuda.is_available():
        print(f"steps.py {args.step}: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 3
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return {"env": env, "train": train, "fp8": fp8, "infer": infer}[args.step](args, rec)


if __name__ == "__main__":
    sys.exit(main())

"""Where FP8 training pays, GEMM by GEMM: bf16 `mm` against `torch._scaled_mm` with e4m3 operands
(tensorwise and rowwise scales) for the three GEMMs of a linear layer's training step (forward,
grad-input, grad-weight), first without the casts (operands already in FP8 and in the layout each GEMM
wants), then the whole layer with its casts: torchao's Float8Linear forward + backward, compiled,
against a bf16 nn.Linear. Shapes: the Linear layers of ViT-H/14 and of timm's vit_giant_patch14_224 and
vit_gigantic_patch14_224 (qkv, proj, fc1, fc2) at M = batch x 257 tokens, and an 8192^3 control.

    python benchmarks/gpu/fp8_gemm.py --json fp8_gemm.json               # on a GPU (compute capability >= 8.9)
    python benchmarks/gpu/fp8_gemm.py --json t.json --dry-run --device cpu  # tiny shapes: checks the script

The JSON's rows (m, k, n, recipe, linear_speedup) are the table `torchcls train --fp8-table` reads:
torchcls.precision.fp8_rule uses a row for layers of the same (K, N) whose M is within 2x. Each row also
carries torchao's roofline ceiling for the shape on this GPU (fp8_rule.roofline_speedup). Measurements
run cheapest first (every GEMM without casts, then the compiled layers in order of importance) and the
JSON is rewritten after each, so a run stopped by --budget-s or a timeout keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchcls.precision.fp8_rule import figures_for, roofline_speedup

E4M3 = torch.float8_e4m3fn
WIDTHS = {"vit_huge_patch14_224": (1280, 5120), "vit_giant_patch14_224": (1408, 6144),
          "vit_gigantic_patch14_224": (1664, 8192)}  # embed dim, MLP hidden (timm)
TOKENS = 257  # 16 x 16 patches of 14 px at 224 px, and the class token


def layer_shapes(batches: list[int], dry_run: bool) -> list[dict[str, Any]]:
    """(family, layer, M, K, N) in order of importance: the largest backbone first, fc1/fc2 before qkv/proj."""
    if dry_run:  # tiny stand-ins with the same structure; FP8 GEMMs need dims divisible by 16
        return [{"family": "tiny", "layer": "fc1", "m": 32, "k": 64, "n": 128},
                {"family": "tiny", "layer": "fc2", "m": 32, "k": 128, "n": 64},
                {"family": "control", "layer": "square", "m": 64, "k": 64, "n": 64}]
    shapes = []
    for family in ("vit_gigantic_patch14_224", "vit_huge_patch14_224", "vit_giant_patch14_224"):
        d, h = WIDTHS[family]
        for b in batches:
            shapes += [{"family": family, "layer": name, "m": b * TOKENS, "k": k, "n": n}
                       for name, k, n in (("fc1", d, h), ("fc2", h, d), ("qkv", d, 3 * d), ("proj", d, d))]
    return shapes + [{"family": "control", "layer": "square", "m": 8192, "k": 8192, "n": 8192}]


def bench_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of fn() after warm-up: CUDA events per call on a GPU, wall time on a CPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major: _scaled_mm wants its second operand so."""
    return t.t().contiguous().t()


def gemm_times(m: int, k: int, n: int, device: torch.device, reps: int) -> dict[str, dict[str, float]]:
    """bf16 mm and _scaled_mm (tensorwise, rowwise) for out = x w^T, grad_x = g w, grad_w = g^T x; operands
    random (never zeros), already cast and laid out: the GEMMs alone."""
    g = torch.Generator(device=device).manual_seed(0)
    x, w, go = (torch.randn(*s, device=device, generator=g, dtype=torch.bfloat16) for s in ((m, k), (n, k), (m, n)))
    bf16 = {"forward": lambda: x @ w.t(), "grad_input": lambda: go @ w, "grad_weight": lambda: go.t() @ x}
    out: dict[str, dict[str, float]] = {"bf16": {k_: bench_ms(f, device, reps) for k_, f in bf16.items()}}
    x8, w8, go8 = x.to(E4M3), w.to(E4M3), go.to(E4M3)
    # (a row-major, b column-major) per GEMM, and the rows/columns each rowwise scale runs along
    operands = {"forward": (x8, w8.t(), m, n), "grad_input": (go8, col_major(w8), m, k),
                "grad_weight": (go8.t().contiguous(), col_major(x8), n, k)}
    one = torch.ones((), device=device)
    for recipe in ("tensorwise", "rowwise"):
        times = {}
        for name, (a, b, rows, cols) in operands.items():
            sa, sb = (one, one) if recipe == "tensorwise" else (torch.ones(rows, 1, device=device),
                                                                 torch.ones(1, cols, device=device))
            try:
                times[name] = bench_ms(lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b, sa, sb,
                                       out_dtype=torch.bfloat16), device, reps)
            except RuntimeError as e:  # e.g. rowwise scales on a CPU build that has per-tensor only
                times[name] = float("nan")
                out.setdefault("errors", {})[f"{recipe}/{name}"] = str(e).splitlines()[0][:200]  # type: ignore[index]
        out[recipe] = times
    return out


def linear_step_ms(m: int, k: int, n: int, recipe: str | None, device: torch.device, reps: int,
                   compile: bool) -> float:
    """Forward + backward of one bias-free bf16 Linear (recipe None) or torchao Float8Linear (recipe):
    the casts included, compiled as torchao recommends."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(k, n, bias=False)).to(device, torch.bfloat16)
    if recipe is not None:
        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    fn = torch.compile(layer) if compile else layer
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    go = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        fn(x).backward(go)

    return bench_ms(step, device, reps)


def row(shape: dict[str, Any], recipe: str, gemms: dict[str, Any], gpu: str) -> dict[str, Any]:
    bf16, fp8 = gemms["bf16"], gemms[recipe]
    total_bf16, total_fp8 = sum(bf16.values()), sum(fp8.values())
    return {**shape, "recipe": recipe, "bf16_gemm_ms": _r(bf16), "fp8_gemm_ms": _r(fp8),
            "gemm_speedup": round(total_bf16 / total_fp8, 3) if total_fp8 == total_fp8 else None,
            "roofline_ceiling": round(roofline_speedup(shape["m"], shape["k"], shape["n"], recipe, figures_for(gpu)), 3),
            "bf16_linear_ms": None, "fp8_linear_ms": None, "linear_speedup": None, "cast_ms": None,
            "errors": {k: v for k, v in gemms.get("errors", {}).items() if k.startswith(recipe)} or None}


def _r(times: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in times.items()} | {"total": round(sum(times.values()), 4)}


def measure_linears(rows: list[dict[str, Any]], args, device: torch.device, save, deadline: float) -> None:
    """The whole layer with casts, compiled, for each (shape, recipe) in order, until the deadline."""
    bf16_ms: dict[tuple[int, int, int], float] = {}
    for r in rows:
        if r["family"] != "control" and r["m"] not in args.linear_m and not args.dry_run:
            continue  # the compiled layers at the whole-model batch only: each shape compiles anew
        if time.perf_counter() > deadline:
            r["linear_skipped"] = "--budget-s spent"
            continue
        key = (r["m"], r["k"], r["n"])
        try:
            if key not in bf16_ms:
                bf16_ms[key] = linear_step_ms(*key, None, device, args.reps, not args.no_compile)
            fp8 = linear_step_ms(*key, r["recipe"], device, args.reps, not args.no_compile)
            r.update(bf16_linear_ms=round(bf16_ms[key], 4), fp8_linear_ms=round(fp8, 4),
                     linear_speedup=round(bf16_ms[key] / fp8, 3),
                     cast_ms=round(fp8 - r["fp8_gemm_ms"]["total"], 4))
        except Exception as e:  # one shape's failure (compile, unsupported recipe) must not end the table
            r["linear_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        save()


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# FP8 vs bf16 per GEMM on {data['gpu']} (torch {data['torch']})", "",
             "| backbone | layer | M | K | N | recipe | bf16 GEMMs ms | FP8 GEMMs ms | GEMMs x | layer with casts x "
             "| roofline x |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['family']} | {r['layer']} | {r['m']} | {r['k']} | {r['n']} | {r['recipe']} | "
                     f"{r['bf16_gemm_ms']['total']} | {r['fp8_gemm_ms']['total']} | {r['gemm_speedup']} | "
                     f"{r['linear_speedup'] if r['linear_speedup'] is not None else '-'} | {r['roofline_ceiling']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the table here (rewritten after every measurement)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="32,64,128", help="images per step: M = batch x 257 tokens")
    p.add_argument("--linear-batch", type=int, default=64, help="the batch whose layers are also measured whole, "
                   "with casts and compiled (the whole-model FP8 step's batch)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=1e9, help="start no compiled-layer measurement after this")
    p.add_argument("--no-compile", action="store_true", help="layers eager (torchao's casts unfused): slower")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes: checks the script (CPU too; with --no-compile "
                   "in seconds)")
    args = p.parse_args()
    start, device = time.perf_counter(), torch.device(args.device)
    args.linear_m = {args.linear_batch * TOKENS}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    data: dict[str, Any] = {"gpu": gpu or "cpu", "torch": torch.__version__, "dry_run": args.dry_run,
                            "tokens_per_image": TOKENS, "rows": []}
    out = Path(args.json)
    save = lambda: out.write_text(json.dumps(data, indent=2))  # noqa: E731
    for shape in layer_shapes([int(b) for b in args.batches.split(",")], args.dry_run):
        gemms = gemm_times(shape["m"], shape["k"], shape["n"], device, args.reps)
        data["rows"] += [row(shape, recipe, gemms, gpu) for recipe in ("tensorwise", "rowwise")]
        save()
    print(f"[{time.perf_counter() - start:.0f} s] GEMMs without casts done", file=sys.stderr, flush=True)
    measure_linears(data["rows"], args, device, save, start + args.budget_s)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

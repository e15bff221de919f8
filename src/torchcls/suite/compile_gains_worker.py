"""One `bench compile` configuration, run in its own process (compiled variants interfere in one process).

The compiled side is the shared inference compile policy (`torchcls.artifacts.compile_for_inference`,
also measured by benchmarks/inference.py), so the gain reported is the gain a user of it gets.

Eager and compiled calls alternate (A B A B ...) so machine noise hits both alike; each side
reports median and spread. Prints one JSON object on the last stdout line.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import sys
import time
from typing import Any

import torch


def _stats(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "p25": q[0], "p75": q[2], "n": len(ms)}


def _timed(fn, x, device) -> tuple[torch.Tensor, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1000


def explain(model, x) -> dict[str, Any]:
    """Graph count and break reasons from torch._dynamo.explain (traces only, does not compile)."""
    torch._dynamo.reset()
    with torch.no_grad():
        e = torch._dynamo.explain(model)(x)
    reasons = sorted({str(getattr(b, "reason", b)).splitlines()[0][:200] for b in e.break_reasons})
    torch._dynamo.reset()
    return {"graphs": e.graph_count, "graph_breaks": e.graph_break_count, "break_reasons": reasons}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from torchcls.artifacts.compiled_classifier import compile_for_inference
    from torchcls.kernel_audit.graph import load_audit_model
    from torchcls.models.parts import is_convnet
    from torchcls.precision.dtypes import DTYPES
    from torchcls.precision.inference import CastIO

    device = torch.device(args.device)
    model, x, _ = load_audit_model(args.model, img_size=args.img_size, batch=args.batch)
    model, x = model.to(device).eval(), x.to(device)
    result: dict[str, Any] = explain(model, x)
    # Eager gets the memory format the compile policy picks (channels_last for convnets), so
    # the comparison is against the best plain eager, not against a layout mismatch.
    if is_convnet(model):
        x = x.contiguous(memory_format=torch.channels_last)
    from torch._dynamo.utils import counters

    # The shared inference compile policy (export/compile.py): freezing, static-shape batch buckets,
    # logits returned on the CPU. Buckets up to 2 × batch + 2 cover the varied batch sizes below.
    t0 = time.perf_counter()
    runner = compile_for_inference(model, x.cpu(), device, args.precision, max_batch=2 * args.batch + 2,
                                   mode=args.mode)  # cold: trace + Inductor codegen + C++/Triton build
    result["compile_s"] = time.perf_counter() - t0
    # Eager runs what the compiled side runs: bf16 is the same CastIO wrapper (bf16 weights), not autocast.
    eager_model = model if args.precision == "fp32" else CastIO(copy.deepcopy(model), DTYPES[args.precision])

    def eager(inp: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return eager_model(inp)

    out_c, out_e = runner(x), eager(x)
    for _ in range(args.warmup):
        eager(x), runner(x)
    eager_ms, compiled_ms = [], []
    for _ in range(args.repeats):  # interleaved
        eager_ms.append(_timed(eager, x, device)[1])
        compiled_ms.append(_timed(runner, x, device)[1])
    frames_before = counters["frames"]["ok"]
    for b in (args.batch + 1, args.batch + 2, max(1, args.batch * 2)):  # varied batch sizes
        runner(torch.cat([x] * (b // args.batch + 1))[:b])
    result["recompiles"] = counters["frames"]["ok"] - frames_before
    e, c = out_e.float().cpu(), out_c.float()
    result |= {"eager_ms": _stats(eager_ms), "compiled_ms": _stats(compiled_ms),
               "speedup": statistics.median(eager_ms) / statistics.median(compiled_ms),
               "max_abs_diff": (e - c).abs().max().item(), "top1_agree": (e.argmax(1) == c.argmax(1)).float().mean().item(),
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--mode", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    try:
        result = {"status": "ok"} | run(args)
    except Exception as e:  # recorded by the parent as a failed configuration
        result = {"status": "failed", "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:500] if str(e).strip() else ''}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

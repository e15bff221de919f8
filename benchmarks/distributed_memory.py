"""Per-rank memory of a ViT-Base-sized model under DDP and FSDP2 at world sizes 1, 2 and 4.

A thin wrapper over `torchcls bench memory` (src/torchcls/suite/memory_scaling.py): each configuration is
a real torchrun job (gloo on CPU, NCCL on GPUs) that builds timm's vit_base_patch16_224 (86M
parameters, random init), applies `parallelize` as `torchcls train --parallel ...` does, runs
two AdamW steps and reports, per rank, parameter, gradient and optimizer-state bytes, activation
bytes, peak memory and the analytic expectation (full size / world size for FSDP2, full size
for DDP). World size 1 is the baseline measured in the same run. Prints JSON, then a Markdown table.

    python benchmarks/distributed_memory.py [--worlds 1 2 4] [--img-size 224] [--out bench-memory]
"""

from __future__ import annotations

import argparse
import json

from torchcls.machine import describe_machine, machine_line
from torchcls.suite.memory_scaling import BenchMemoryConfig, bench_memory, to_markdown

MODEL = "vit_base_patch16_224"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=2, help="images per rank")
    ap.add_argument("--out", default="bench-memory", help="folder for bench_memory.json/.md/.png")
    args = ap.parse_args()
    cfg = BenchMemoryConfig(MODEL, ["ddp", "fsdp2"], args.worlds, batch=args.batch, img_size=args.img_size)
    data = bench_memory(cfg, args.out)
    data["machine"] = describe_machine("fp32") | data.get("machine", {})  # the ranks' training steps are fp32
    print(json.dumps(data, indent=2))
    print(f"Machine: {machine_line(data['machine'])}\n")
    print(to_markdown(data))


if __name__ == "__main__":
    main()

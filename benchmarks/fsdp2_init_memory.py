"""Peak memory per rank while an FSDP2 model is built and sharded: every rank building the whole
model (`--no-fsdp-init-from-rank0`) vs rank 0 building it and the others receiving their shards
(the default). Real torchrun jobs (gloo on CPU, NCCL on GPUs); prints JSON and a Markdown table.

    python benchmarks/fsdp2_init_memory.py --model vit_base_patch16_224 --world 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {"every rank builds": False, "rank 0 builds": True}


def worker(args: argparse.Namespace) -> None:
    import torch

    from torchcls.config import Config
    from torchcls.models import ModelSpec, create_model
    from torchcls.training import distributed, rank0_init
    from torchcls.training.parallel import parallelize
    from torchcls.training.rank_memory import peak_memory

    cfg = Config()
    cfg.parallel.parallel, cfg.data.batch_size = "fsdp2", int(os.environ["WORLD_SIZE"])
    session = distributed.setup(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    build = lambda: create_model(ModelSpec(args.model, 1000, 3, 224))  # noqa: E731
    torch.manual_seed(0)
    if args.from_rank0:  # what `torchcls train --parallel fsdp2` does
        model, weights = rank0_init.build_on_meta(build, session.rank)
        model = parallelize(model, cfg.parallel, device)
        rank0_init.materialize(model, weights, device, cfg.parallel)
    else:  # --no-fsdp-init-from-rank0
        model = parallelize(build().to(device), cfg.parallel)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    mem = peak_memory()
    peak = mem.get("cuda_peak_allocated_bytes", mem["peak_rss_bytes"])
    rows = session.gather_objects({"rank": session.rank, "shard_bytes": shard, "peak_bytes": peak,
                                   "measure": "CUDA peak allocated" if device.type == "cuda" else "peak RSS"})
    if session.is_main:
        Path(args.out).write_text(json.dumps(rows))
    session.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--from-rank0", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, from_rank0 in MODES.items():
            out = Path(tmp) / "ranks.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
                   __file__, "--worker", "--model", args.model, "--out", str(out)] + ["--from-rank0"] * from_rank0
            subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
            results.append({"mode": mode, "ranks": json.loads(out.read_text())})
    from torchcls.machine import describe_machine, machine_line

    machine = describe_machine("fp32 weights (no training step)") | {"rank_threads": 1}  # OMP_NUM_THREADS=1 ranks
    print(json.dumps({"model": args.model, "world": args.world, "machine": machine, "results": results}, indent=2))
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print(f"\nMachine: {machine_line(machine)}, 1 thread per rank")
    print(f"\n| mode | rank | shard MiB | {results[0]['ranks'][0]['measure']} while building + sharding MiB |")
    print("|---|---|---|---|")
    for r in results:
        for k in r["ranks"]:
            print(f"| {r['mode']} | {k['rank']} | {mib(k['shard_bytes'])} | {mib(k['peak_bytes'])} |")


if __name__ == "__main__":
    main()

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
    import torch.distributed as dist

    from torchcls.config import TrainConfig
    from torchcls.models import ModelSpec, create_model
    from torchcls.train import rank0_init
    from torchcls.train.memory import peak_memory
    from torchcls.train.parallel import parallelize

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = TrainConfig(parallel="fsdp2", fsdp_init_from_rank0=args.from_rank0)
    build = lambda: create_model(ModelSpec(args.model, 1000, 3, 224))  # noqa: E731
    torch.manual_seed(0)
    if args.from_rank0:
        model, weights = rank0_init.build_on_meta(build, dist.get_rank())
        model = parallelize(model, cfg, device)
        rank0_init.materialize(model, weights, device, cfg)
    else:
        model = parallelize(build().to(device), cfg)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() if cuda else peak_memory()["peak_rss_bytes"]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"rank": dist.get_rank(), "shard_bytes": shard, "peak_bytes": peak,
                                  "measure": "CUDA peak allocated" if cuda else "peak RSS"})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


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
    print(json.dumps({"model": args.model, "world": args.world, "results": results}, indent=2))
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print(f"\n| mode | rank | shard MiB | {results[0]['ranks'][0]['measure']} while building + sharding MiB |")
    print("|---|---|---|---|")
    for r in results:
        for k in r["ranks"]:
            print(f"| {r['mode']} | {k['rank']} | {mib(k['shard_bytes'])} | {mib(k['peak_bytes'])} |")


if __name__ == "__main__":
    main()

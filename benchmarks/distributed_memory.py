"""Per-rank memory of a ViT-Base-sized model under DDP and FSDP2 at world sizes 1, 2 (and 4 where it fits).

Each configuration is a real torchrun job (gloo on CPU, NCCL on GPUs): every rank builds
timm's vit_base_patch16_224 (86M parameters, random init) through torchcls's registry,
applies `parallelize` exactly as `torchcls train --parallel ...` does, runs two AdamW steps
on a tiny batch (2 images of 32 px per rank: memory of the *state*, not of activations, is
the subject) and reports, per rank, the parameter, gradient and optimizer-state bytes it
holds, the analytic expectation (full size / world size for FSDP2, full size for DDP) and
its peak memory (peak RSS on CPU; CUDA allocator peak and reserved on GPU).
World size 1 is the baseline measured in the same run. Prints JSON, then a Markdown table.

    python benchmarks/distributed_memory.py [--worlds 1 2 4] [--out bench-memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "vit_base_patch16_224"
FULL_STATE_BYTES = 86_000_000 * 4 * 4  # params + grads + 2 AdamW moments, fp32


def worker(mode: str, out: str) -> None:
    import torch

    from torchcls.config import Config
    from torchcls.models import ModelSpec, create_model
    from torchcls.train import distributed
    from torchcls.train.memory import measure
    from torchcls.train.optim import build_optimizer
    from torchcls.train.parallel import parallelize

    cfg = Config()
    cfg.train.parallel, cfg.data.batch_size = mode, 2 * int(os.environ["WORLD_SIZE"])
    session = distributed.setup(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = create_model(ModelSpec(MODEL, 1000, 3, 32)).to(device)
    model = parallelize(model, cfg.train)
    optimizer = build_optimizer(model, cfg.optim)
    for _ in range(2):
        x, y = torch.randn(2, 3, 32, 32, device=device), torch.randint(0, 1000, (2,), device=device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    ranks = session.gather_objects(measure(model, optimizer, session))
    if session.is_main:
        Path(out).write_text(json.dumps(ranks))
    session.close()


def launch(mode: str, world: int, tmp: Path) -> list[dict]:
    out = tmp / f"{mode}-{world}.json"
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           __file__, "--worker", mode, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} x{world} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def fits(mode: str, world: int) -> bool:
    import psutil

    per_rank = FULL_STATE_BYTES * (1.0 if mode == "ddp" else 1.0 / world) * 1.6 + 600e6  # + buckets, runtime
    return per_rank * world < 0.7 * psutil.virtual_memory().available


def table(results: list[dict]) -> str:
    mb = lambda b: f"{b / 2**20:.1f}"
    lines = ["| mode | world | rank | params MB | grads MB | optimizer MB | total MB | expected MB | "
             "total / world-1 total | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['mode']} | {r['world']} | - | skipped: {r['skipped']} ||||||| |")
            continue
        for rank in r["ranks"]:
            lines.append(f"| {r['mode']} | {r['world']} | {rank['rank']} | {mb(rank['param_bytes'])} | "
                         f"{mb(rank['grad_bytes'])} | {mb(rank['optimizer_bytes'])} | {mb(rank['total_bytes'])} | "
                         f"{mb(rank['expected_total_bytes'])} | {rank['ratio_to_world1']:.3f} | "
                         f"{mb(rank['peak_rss_bytes'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("ddp", "fsdp2"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.out)
    results = []
    with tempfile.TemporaryDirectory(prefix="torchcls-bench-") as tmp:
        for world in args.worlds:
            for mode in ("ddp", "fsdp2"):
                if world > 1 and not fits(mode, world):
                    results.append({"mode": mode, "world": world, "skipped": "not enough free memory"})
                    continue
                results.append({"mode": mode, "world": world, "ranks": launch(mode, world, Path(tmp))})
    base = {r["mode"]: r["ranks"][0]["total_bytes"] for r in results if r["world"] == 1 and "ranks" in r}
    for r in results:
        for rank in r.get("ranks", []):
            rank["ratio_to_world1"] = rank["total_bytes"] / base.get(r["mode"], rank["total_bytes"])
            rank.pop("full", None)
    doc = {"model": MODEL, "note": "CPU/gloo on a shared 2-core machine; bytes are exact, peak RSS includes "
                                   "the PyTorch runtime and activations", "results": results}
    print(json.dumps(doc, indent=2))
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()

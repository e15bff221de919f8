"""Training throughput of `torchcls.training` vs a plain hand-written eager PyTorch loop.

Same model (SmallNet), data (mnist-5k train split, same transforms), batch size,
optimizer and threads. Rounds are interleaved (torchcls, plain, torchcls, plain, ...)
because this machine's speed drifts; the figure is the median images/s of the
training epochs (validation excluded on both sides). torchcls runs twice: with its NaN/Inf check
deferred (`--nonfinite-check deferred`: no host synchronisation per step, the CUDA default) and read
on the host every step (the CPU default). Prints JSON, then a Markdown table; both name the machine
(CPU model, SIMD level, usable cores and quota, torch threads, precision).

    python benchmarks/train_throughput.py --rounds 3 --epochs 1

--threads-study instead compares torchcls's intra-op thread counts: the default (OMP_NUM_THREADS, else
the affinity- and quota-aware rule of torchcls.machine), --threads 1 and --threads 2, each alone and
beside a competing process (a Python busy loop pinned to one of this process's cores, as another job
on a shared machine). Interleaved per round, medians:

    python benchmarks/train_throughput.py --threads-study --rounds 3 --epochs 1

--vs-timm: `torchcls train` against timm's own pipeline (loader, model, optimizer, scheduler, AMP) on one
recipe (benchmarks/timm_pipeline.py), in fp32 and in what --precision auto picks; images/s and test top-1:

    python benchmarks/train_throughput.py --vs-timm --rounds 2 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from torchcls.config import Config
from torchcls.data import build_data, make_loader
from torchcls.machine import describe_machine, machine_line
from torchcls.models import ModelSpec, create_model
from torchcls.training import train
from torchcls.training.rundir import read_metrics


def bench_config(args: argparse.Namespace, out: Path, name: str) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.batch_size, cfg.data.workers = args.data, args.batch_size, args.workers
    cfg.model.name, cfg.train.epochs, cfg.train.progress = "smallnet", args.epochs, False
    cfg.train.channels_last, cfg.train.threads = args.channels_last, args.threads
    cfg.precision.precision = args.precision
    cfg.run.out_dir, cfg.run.name = str(out), name
    return cfg


def ran_in(precision: str) -> str:
    """What --precision runs as here (auto: bf16 where the CPU has it natively), for the machine record."""
    from torchcls.precision.hardware import choose_precision

    return choose_precision(precision, torch.device("cpu")).precision


def epoch_rate(run_dir: Path) -> float:
    return statistics.median(r["img_per_s"] for r in read_metrics(run_dir) if r["kind"] == "epoch")


def torchcls_round(args, out: Path, i: int, check: str = "deferred") -> float:
    """--nonfinite-check deferred: no host synchronisation per step (the default on CUDA); every-step:
    the loss read on the host each step (the default on the CPU, where it costs no device round trip)."""
    cfg = bench_config(args, out, f"torchcls-{check}-{i}")
    cfg.precision.nonfinite_check = check
    return epoch_rate(train(cfg).run_dir)


def plain_round(args, out: Path, i: int) -> float:
    """What a person writes by hand: model, AdamW, cross-entropy, a DataLoader, a for loop."""
    cfg = bench_config(args, out, f"plain-{i}")
    torch.manual_seed(cfg.train.seed)
    data = build_data(cfg.data, cfg.train.seed)
    model = create_model(ModelSpec("smallnet", len(data.classes), 1, 28))
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    loader = make_loader(data.train, args.batch_size, args.workers, shuffle=True)
    rates = []
    for _ in range(args.epochs):
        t0, seen = time.perf_counter(), 0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.to(memory_format=fmt)), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(y)
        rates.append(seen / (time.perf_counter() - t0))
    return statistics.median(rates)


THREAD_SETTINGS = {"default": 0, "--threads 1": 1, "--threads 2": 2}


def busy_core() -> subprocess.Popen:
    """A competing process: a Python busy loop pinned to the last core this process may use."""
    cpu = max(os.sched_getaffinity(0))
    return subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


def threads_study(args, out: Path) -> dict:
    """torchcls training at each THREAD_SETTINGS value, alone and beside busy_core(), interleaved per round."""
    rates: dict[str, list[float]] = {}
    used: dict[str, int] = {}
    train(bench_config(args, out, "warm-up"))  # not measured: the process's first run pays one-time costs
    for i in range(args.rounds):
        for competing in (False, True):
            rival = busy_core() if competing else None
            try:
                for name, threads in THREAD_SETTINGS.items():
                    key = f"{name}{' + busy core' if competing else ''}"
                    cfg = bench_config(args, out, f"threads-{threads}-{int(competing)}-{i}")
                    cfg.train.threads = threads
                    run_dir = train(cfg).run_dir
                    rates.setdefault(key, []).append(epoch_rate(run_dir))
                    used[key] = json.loads((run_dir / "machine.json").read_text())["torch_threads"]
            finally:
                if rival is not None:
                    rival.kill()
                    rival.wait()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"benchmark": "train_threads", "model": "smallnet", "data": args.data, "batch_size": args.batch_size,
            "workers": args.workers, "rounds": args.rounds, "machine": describe_machine(ran_in(args.precision)),
            "threads_used": used, "img_per_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
            "median_img_per_s": {k: round(v, 1) for k, v in med.items()}}


def print_study(result: dict) -> None:
    print(json.dumps(result, indent=2))
    print(f"\nMachine: {machine_line(result['machine'])}\n\n| threads | competing process | torch threads | "
          "median images/s | rounds |\n|---|---|---|---|---|")
    for key, rounds in result["img_per_s"].items():
        name, _, busy = key.partition(" + ")
        print(f"| {name} | {busy or 'none'} | {result['threads_used'][key]} | "
              f"{result['median_img_per_s'][key]:.0f} | {', '.join(f'{r:.0f}' for r in rounds)} |")


def vs_timm(args, out: Path) -> dict:
    """Both pipelines on the recipe of timm_pipeline.RECIPE, per precision mode, interleaved rounds, medians.
    In auto, timm's side uses AMP bf16 where the CPU has native bf16 (what a timm user would turn on)."""
    import timm_pipeline as tp
    from torchcls.precision.hardware import cpu_bf16_here

    data = tp.folder(Path(args.cache_dir).expanduser(), args.images)
    native = cpu_bf16_here()[0]
    runs: dict[str, dict[str, list[dict]]] = {m: {"torchcls": [], "timm": []} for m in ("fp32", "auto")}
    for i in range(args.rounds):
        for mode, sides in runs.items():
            arms = [lambda: sides["torchcls"].append(tp.torchcls_side(data, out, f"{mode}-{i}", args.epochs, mode, seed=i)),
                    lambda: sides["timm"].append(tp.timm_side(data, args.epochs, mode == "auto" and native, seed=i))]
            for arm in arms[::-1] if i % 2 else arms:  # each side goes first in every other round
                arm()
    summary = {}
    for mode, sides in runs.items():
        med = {side: statistics.median(r["img_per_s"] for r in rounds) for side, rounds in sides.items()}
        top1 = {side: statistics.median(r["test_top1"] for r in rounds) for side, rounds in sides.items()}
        summary[mode] = {"median_img_per_s": {k: round(v, 1) for k, v in med.items()},
                         "ratio": round(med["torchcls"] / med["timm"], 3),
                         "test_top1": {k: round(v, 4) for k, v in top1.items()},
                         "ran": {side: rounds[-1]["ran"] for side, rounds in sides.items()}}
    return {"benchmark": "train_vs_timm", "recipe": tp.RECIPE, "images": args.images, "epochs": args.epochs,
            "rounds": args.rounds, "machine": describe_machine("fp32, auto"), "runs": runs, "summary": summary}


def print_vs_timm(result: dict) -> None:
    print(json.dumps(result, indent=2))
    print(f"\nMachine: {machine_line(result['machine'])}\n\n| precision mode | torchcls ran | timm ran | "
          "torchcls images/s | timm images/s | ratio | test top-1 torchcls / timm |\n|---|---|---|---|---|---|---|")
    for mode, s in result["summary"].items():
        m, t = s["median_img_per_s"], s["test_top1"]
        print(f"| {mode} | {s['ran']['torchcls']} | {s['ran']['timm']} | {m['torchcls']:.0f} | {m['timm']:.0f} | "
              f"{s['ratio']:.2f}x | {t['torchcls']:.2%} / {t['timm']:.2%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="mnist-5k")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--precision", default="fp32", choices=("auto", "fp32", "bf16"),
                   help="torchcls's training precision (the plain loop is fp32: compare them at fp32)")
    p.add_argument("--threads-study", action="store_true", help="compare default / --threads 1 / --threads 2, "
                   "alone and beside a competing busy process")
    p.add_argument("--vs-timm", action="store_true", help="torchcls train vs timm's pipeline on one recipe "
                   "(benchmarks/timm_pipeline.py), in fp32 and in what --precision auto picks")
    p.add_argument("--images", type=int, default=10_000, help="--vs-timm: Fashion-MNIST training images as PNGs")
    p.add_argument("--cache-dir", default="~/.cache/torchcls-bench", help="--vs-timm: where the PNG folder is kept")
    args = p.parse_args()
    if args.threads_study or args.vs_timm:
        with tempfile.TemporaryDirectory() as tmp:
            if args.vs_timm:
                return print_vs_timm(vs_timm(args, Path(tmp)))
            return print_study(threads_study(args, Path(tmp)))
    torch.set_num_threads(args.threads)
    rates: dict[str, list[float]] = {"torchcls": [], "torchcls-sync-every-step": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # interleaved: this machine's speed drifts
            rates["torchcls"].append(torchcls_round(args, Path(tmp), i))
            rates["torchcls-sync-every-step"].append(torchcls_round(args, Path(tmp), i, "every-step"))
            rates["plain"].append(plain_round(args, Path(tmp), i))
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"benchmark": "train_throughput", "model": "smallnet", "data": args.data,
              "machine": describe_machine(ran_in(args.precision)),
              "batch_size": args.batch_size, "threads": args.threads, "workers": args.workers,
              "channels_last": args.channels_last, "rounds": args.rounds,
              "img_per_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
              "median_img_per_s": {k: round(v, 1) for k, v in med.items()},
              "ratio_torchcls_over_plain": round(med["torchcls"] / med["plain"], 3),
              "ratio_no_sync_over_sync": round(med["torchcls"] / med["torchcls-sync-every-step"], 3)}
    print(json.dumps(result, indent=2))
    print(f"\nMachine: {machine_line(result['machine'])}\n\n| loop | median images/s | rounds |\n|---|---|---|")
    for k in rates:
        print(f"| {k} | {med[k]:.0f} | {', '.join(f'{r:.0f}' for r in rates[k])} |")
    print(f"\ntorchcls / plain = {result['ratio_torchcls_over_plain']:.3f}; without / with the per-step host "
          f"synchronisation = {result['ratio_no_sync_over_sync']:.3f}")


if __name__ == "__main__":
    sys.exit(main())

"""Overhead of data governance: manifest time for Fashion-MNIST's 70k images, the start of a run
on a PNG folder with a cold and a warm hash cache (unchanged files are not re-read), and the
training slowdown of a governed run (policy checks, manifest, hooks, sample redaction, audit
record) against the same run with governance off.

Two training scenarios, rounds interleaved (plain, governed, plain, governed, ...) because this
machine's speed drifts; figures are medians. Prints JSON, then a Markdown table.

    python benchmarks/governance_overhead.py --rounds 2 --epochs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torchcls.config import Config
from torchcls.governance import hook
from torchcls.governance.manifest import build_manifest, save_manifest
from torchcls.machine import describe_machine, machine_line
from torchcls.training import train
from torchcls.training.rundir import read_metrics


@hook("bench-identity", "tensor")
def identity(x, info):  # the cheapest possible per-sample hook: measures the hook path itself
    return x


POLICY = """[policy]
name = "bench"
[processing]
allowed_regions = ["eu-*"]
[data]
allowed_licenses = ["CC-BY-SA-3.0", "MIT", "CC-BY-4.0"]
[hooks]
public = ["redact-samples"]
"""


def manifest_figures(rounds: int, out: Path) -> dict:
    times, write = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        m = build_manifest("fashion-mnist")
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        path = save_manifest(m, out / "fashion.manifest.json")
        write.append(time.perf_counter() - t0)
    return {"records": m["tc:recordCount"], "hash_s": statistics.median(times), "write_s": statistics.median(write),
            "json_mb": path.stat().st_size / 1e6, "rounds_s": times}


def run_start_figures(folder: Path, rounds: int, out: Path) -> dict:
    """governance.begin (list, hash, manifest) on the folder: a fresh OUT_DIR (cold hash cache),
    then the same OUT_DIR again (warm), interleaved; medians and the cache's hit/miss counts."""
    from torchcls import governance

    for p in folder.rglob("*"):  # files written moments ago are never cached: age them
        os.utime(p, (1_600_000_000, 1_600_000_000))
    cold, warm, stats = [], [], {}
    for i in range(rounds):
        cfg = config(str(folder), out / f"start-{i}", "start", argparse.Namespace(epochs=1), False, False)
        cfg.governance.lineage = True
        for times, kind in ((cold, "cold"), (warm, "warm")):
            t0 = time.perf_counter()
            gov = governance.begin(cfg, out / f"start-{i}" / kind)
            times.append(time.perf_counter() - t0)
            stats[kind] = gov.hashes.stats()
    return {"files": stats["cold"]["misses"], "cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
            "cache": stats}


def shapes_folder(root: Path, per_class: int) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_image_folder

    return make_image_folder(root, per_class=per_class, size=32)


def config(data: str, out: Path, name: str, args, governed: bool, file_hooks: bool) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.workers, cfg.data.batch_size = data, 0, 128
    cfg.train.epochs, cfg.train.progress, cfg.train.channels_last = args.epochs, False, True
    if data not in ("mnist-5k", "fashion-mnist"):
        cfg.data.img_size = 32
    cfg.run.out_dir, cfg.run.name = str(out), name
    g = cfg.governance
    g.lineage = governed
    if governed:
        policy = out / "policy.toml"
        policy.write_text(POLICY)
        g.policy, g.region, g.sample_grid = str(policy), "eu-west-1", 16
        g.hooks = "redact-samples,bench-identity" + (",strip-exif" if file_hooks else "")
        if data not in ("mnist-5k", "fashion-mnist"):
            from torchcls.governance.cli_api import write_manifest
            from torchcls.governance.manifest import DatasetMeta

            path, _ = write_manifest(data, out / f"{name}.manifest.json", meta=DatasetMeta(license="CC-BY-4.0",
                                                                                           tags=["public"]))
            g.data_manifest = str(path)
    return cfg


def scenario(data: str, args, out: Path, file_hooks: bool) -> dict:
    res = {"plain": {"total_s": [], "img_per_s": []}, "governed": {"total_s": [], "img_per_s": []}}
    for i in range(args.rounds):
        for kind in ("plain", "governed"):
            cfg = config(data, out, f"{kind}-{Path(data).name}-{i}", args, kind == "governed", file_hooks)
            t0 = time.perf_counter()
            result = train(cfg)
            res[kind]["total_s"].append(time.perf_counter() - t0)
            res[kind]["img_per_s"].append(statistics.median(
                r["img_per_s"] for r in read_metrics(result.run_dir) if r["kind"] == "epoch"))
    for kind in res:
        res[kind] |= {"total_s_median": statistics.median(res[kind]["total_s"]),
                      "img_per_s_median": statistics.median(res[kind]["img_per_s"])}
    res["slowdown_total"] = res["governed"]["total_s_median"] / res["plain"]["total_s_median"]
    res["slowdown_img_per_s"] = res["plain"]["img_per_s_median"] / res["governed"]["img_per_s_median"]
    return res


def ran_in_auto() -> str:
    """What the runs' default precision (auto) is on this machine."""
    import torch

    from torchcls.precision.hardware import choose_precision

    return choose_precision("auto", torch.device("cpu")).precision


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--folder-per-class", type=int, default=200, help="images per class in the PNG-folder scenario")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gov-bench-") as tmp:
        out = Path(tmp)
        figures = {"machine": describe_machine(f"auto -> {ran_in_auto()}") | {
                       "note": "shared 2-core CPU (7 other developers): numbers are noisy"},
                   "manifest_fashion_mnist": manifest_figures(args.rounds, out),
                   "train_mnist_5k": scenario("mnist-5k", args, out / "runs", file_hooks=False)}
        folder = shapes_folder(out / "shapes", args.folder_per_class)
        figures["run_start_png_folder"] = run_start_figures(folder, args.rounds, out / "start")
        figures["train_png_folder_strip_exif"] = scenario(str(folder), args, out / "runs", file_hooks=True)
    print(json.dumps(figures, indent=2))
    m = figures["manifest_fashion_mnist"]
    print(f"\nMachine: {machine_line(figures['machine'])}")
    print(f"\n| what | plain | governed | slowdown |\n|---|---|---|---|\n"
          f"| Fashion-MNIST manifest ({m['records']:,} sample hashes + Merkle root) | | "
          f"{m['hash_s']:.2f} s (+{m['write_s']:.2f} s to write {m['json_mb']:.1f} MB JSON) | |")
    r = figures["run_start_png_folder"]
    print(f"| run start on {r['files']} PNGs (list, hash, manifest): cold / warm hash cache | | "
          f"{r['cold_s']:.2f} s / {r['warm_s']:.2f} s ({r['cache']['warm']['hits']} files not re-read) | |")
    for key, label in (("train_mnist_5k", "mnist-5k, SmallNet, tensor hook + redaction + audit"),
                       ("train_png_folder_strip_exif", f"{2 * args.folder_per_class} PNGs, strip-exif isolation")):
        s = figures[key]
        print(f"| {label}: whole run | {s['plain']['total_s_median']:.1f} s | {s['governed']['total_s_median']:.1f} s "
              f"| {s['slowdown_total']:.2f}x |")
        print(f"| {label}: training img/s | {s['plain']['img_per_s_median']:.0f} | "
              f"{s['governed']['img_per_s_median']:.0f} | {s['slowdown_img_per_s']:.2f}x |")


if __name__ == "__main__":
    main()

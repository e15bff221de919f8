"""Which fast-training methods get Fashion-MNIST to 94% sooner: an ablation of the fmnist-fast recipe.

The methods of airbench (KellerJordan/cifar10-airbench, arXiv 2404.00498), each a torchcls training option,
are switched on one at a time on top of the recipe (`baseline` = the recipe as shipped); then the ones
that paid (median seconds to 94% below the baseline's, or, where neither reaches it, a higher median final
top-1) are combined (`all-kept`; --combine names them instead). Every variant trains once per --seeds, and
benchmarks/fashion_mnist.py's `run` tests each epoch's checkpoint on the 10,000 test images. Prints JSON,
then a Markdown table (medians over the seeds). Never asserts on time.

Run it on a quiet machine: with a 1-minute load average over 0.5 before it starts, the figures are marked
not for publication ("publishable": false) and a warning says so. Any `torchcls train` flag overrides the
recipe for every variant (e.g. --epochs 6).

    python benchmarks/fmnist_ablation.py --seeds 0,1,2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/fmnist_ablation.py --seeds 0,1,2 --epochs 6      # the AVX2 stand-in
    python benchmarks/fmnist_ablation.py --methods baseline,whiten,lookahead --seeds 0
    python benchmarks/fmnist_ablation.py --smoke    # 1 epoch on 500 mnist-5k images: the script works
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

from fashion_mnist import TARGET, run  # the per-epoch test machinery (benchmarks/ is the script's own folder)
from torchcls.config import Config, set_option
from torchcls.machine import describe_machine
from torchcls.options import add_config_flags, config_from_args
from torchcls.recipes import recipe_evaluation

QUIET_LOAD = 0.5  # 1-minute load average above which a timing is not published
# name: (what it adds, in flags, and the options it sets; "tta" is the per-epoch test's, not a training option)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("the recipe as shipped", {}),
    # The recipe has whitening and fastnet_lite since 2026-12-06: these take each back out.
    "no-whiten": ("--init '' --no-freeze-first-conv", {"model.init": "", "model.freeze_first_conv": False}),
    "slim": ("--model fastnet_slim (fastnet_lite with a residual block at 14 px)", {"model.name": "fastnet_slim"}),
    "fastnet": ("--model fastnet (24/48 channels at 28/14 px, the recipe's 16/32; with the 14 px block)",
                {"model.name": "fastnet"}),
    "whiten": ("--init whiten --freeze-first-conv", {"model.init": "whiten", "model.freeze_first_conv": True}),
    "dirac": ("--init dirac", {"model.init": "dirac"}),
    "bn-bias-lr": ("--bn-bias-lr-scale 64", {"optim.bn_bias_lr_scale": 64.0}),
    "freeze-first-bias": ("--freeze-first-bias-after-epochs 3", {"optim.freeze_first_bias_after_epochs": 3}),
    "lookahead": ("--lookahead 5 --lookahead-alpha 0.5", {"optim.lookahead": 5, "optim.lookahead_alpha": 0.5}),
    "no-label-smoothing": ("--label-smoothing 0 (the recipe has 0.1)", {"optim.label_smoothing": 0.0}),
    "flip-alternate": ("--augment flip-alternate", {"data.augment": "flip-alternate"}),
    "multicrop": ("evaluate --tta multicrop (the recipe tests with flip)", {"tta": "multicrop"}),
    "selective-backprop": ("--selective-backprop 0.5 --selective-backprop-after-epochs 2",
                           {"optim.selective_backprop": 0.5, "optim.selective_backprop_after_epochs": 2}),
}


def parse() -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_flags(p)
    p.add_argument("--methods", default=",".join(METHODS), help=f"variants to train (default: all: {', '.join(METHODS)})")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; every variant trains once per seed (e.g. 0,1,2)")
    p.add_argument("--combine", default=None, help="methods to train together as 'all-kept' (default: the ones "
                   "that paid in this run; 'none': no combined run)")
    p.add_argument("--test-from", type=int, default=1, metavar="EPOCH", help="first epoch tested (fashion_mnist.py)")
    p.add_argument("--smoke", action="store_true", help="1 epoch on 500 mnist-5k images, tested on the other 4,500 "
                   "(mnist-5k has no test split): checks the script, measures nothing")
    p.set_defaults(recipe="fmnist-fast")
    args = p.parse_args()
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    if args.recipe == "none":
        args.recipe = None
    cfg = config_from_args(args)
    if args.smoke:
        cfg.data.source, cfg.data.val_fraction, cfg.train.epochs = "mnist-5k", 0.9, 1
    return cfg, args


def variant(base: Config, overrides: dict[str, Any], seed: int, tta: str) -> tuple[Config, str]:
    cfg = copy.deepcopy(base)
    for key, value in overrides.items():
        if key == "tta":
            tta = value
            continue
        section, name = key.split(".")
        set_option(cfg, section, name, value, f"fmnist_ablation {key}")
    cfg.train.seed = seed
    return cfg, tta


def combined(names: list[str]) -> dict[str, Any]:
    """The options of several methods at once (--init lists join: whiten,dirac)."""
    out: dict[str, Any] = {}
    for name in names:
        for key, value in METHODS[name][1].items():
            out[key] = f"{out[key]},{value}" if key == "model.init" and key in out else value
    return out


def measure(name: str, overrides: dict[str, Any], base: Config, args, tta: str, split: str) -> dict[str, Any]:
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        cfg, view = variant(base, overrides, seed, tta)
        print(f"== {name}, seed {seed}", file=sys.stderr, flush=True)
        per_epoch, total, machine = run(cfg, view, args.test_from, split)
        reached = next((e for e in per_epoch if (e["test_top1"] or 0.0) >= TARGET), None)
        runs.append({"seed": seed, "per_epoch": per_epoch, "seconds": round(total, 1), "machine": machine,
                     "seconds_to_target": reached["train_s"] if reached else None, "tta": view})
    return {"method": name, "options": overrides, "runs": runs, **summary(runs)}


def summary(runs: list[dict]) -> dict[str, Any]:
    """Medians over the seeds: top-1 after each epoch, final top-1, seconds to the target (a seed that
    misses it counts as infinitely slow, so the median is reached only when most seeds reach it)."""
    epochs = min(len(r["per_epoch"]) for r in runs)
    per_epoch = [_median([r["per_epoch"][i]["test_top1"] for r in runs]) for i in range(epochs)]
    seconds = statistics.median([r["seconds_to_target"] or math.inf for r in runs])
    return {"median_top1_per_epoch": per_epoch, "median_final_top1": per_epoch[-1] if per_epoch else None,
            "median_seconds_to_target": None if math.isinf(seconds) else seconds,
            "seeds_reaching_target": sum(r["seconds_to_target"] is not None for r in runs)}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def paid(result: dict, baseline: dict) -> bool:
    s, b = result["median_seconds_to_target"], baseline["median_seconds_to_target"]
    if s is not None or b is not None:
        return s is not None and (b is None or s < b)
    return (result["median_final_top1"] or 0.0) > (baseline["median_final_top1"] or 0.0)


def load() -> dict[str, Any]:
    """The load averages and `uptime`'s line, before and after: whether the machine was quiet."""
    line = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip() if shutil.which("uptime") else ""
    return {"loadavg": [round(v, 2) for v in os.getloadavg()], "uptime": line}


def table(results: list[dict], tta: str) -> str:
    rows = ["| method | adds | median test top-1 per epoch | median final | median s to 94% | seeds at 94% |",
            "|---|---|---|---|---|---|"]
    for r in results:
        what = METHODS[r["method"]][0] if r["method"] in METHODS else " + ".join(r["combines"])
        epochs = " / ".join("–" if v is None else f"{v:.2%}" for v in r["median_top1_per_epoch"])
        final = "–" if r["median_final_top1"] is None else f"{r['median_final_top1']:.2%}"
        secs = "not reached" if r["median_seconds_to_target"] is None else f"{r['median_seconds_to_target']:.0f}"
        rows.append(f"| {r['method']} | {what} | {epochs} | {final} | {secs} | {r['seeds_reaching_target']}/"
                    f"{len(r['runs'])} |")
    return "\n".join(rows) + f"\n\n(test-time augmentation: {tta} unless the method says otherwise)"


def main() -> None:
    base, args = parse()
    tta = recipe_evaluation(args.recipe).get("tta", "none") if args.recipe else "none"
    split = "val" if args.smoke else "test"
    before, machine = load(), describe_machine()
    publishable = before["loadavg"][0] <= QUIET_LOAD and not args.smoke
    if before["loadavg"][0] > QUIET_LOAD:
        print(f"WARNING: load average {before['loadavg'][0]} > {QUIET_LOAD} before the run: the timings are not for "
              "publication (run it on a quiet machine)", file=sys.stderr, flush=True)
    results = [measure(m, METHODS[m][1], base, args, tta, split) for m in args.methods.split(",")]
    baseline = next((r for r in results if r["method"] == "baseline"), None)
    keep = ([] if args.combine == "none" else args.combine.split(",") if args.combine else
            [r["method"] for r in results if baseline and r is not baseline and paid(r, baseline)])
    if len(keep) > 1:
        results.append({**measure("all-kept", combined(keep), base, args, tta, split), "combines": keep})
    after = load()
    detail = {"benchmark": "fmnist_ablation", "recipe": args.recipe, "target": TARGET, "split": split,
              "tta": tta, "seeds": args.seeds, "publishable": publishable, "machine": machine,
              "run_machine": results[0]["runs"][0]["machine"], "load_before": before, "load_after": after,
              "config": base.to_dict(), "results": results}
    print(json.dumps(detail, indent=2))
    print("\n" + table(results, tta))
    if not publishable:
        print("\nNOT FOR PUBLICATION: " + ("--smoke" if args.smoke else f"load average {before['loadavg'][0]} "
                                           f"before the run (> {QUIET_LOAD})"))


if __name__ == "__main__":
    sys.exit(main())

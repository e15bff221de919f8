"""The steps of the device check (check.py runs them): what each runs on the GPU, its CPU stand-in for the
rehearsal (`check.sh --rehearse`: the same scripts at tiny sizes with --device cpu, under the torch the
device has), its budget and its part. Standard library only: --dry-run needs no torch.

Part 1 (one call of at most PART_BUDGET_S[1] s) holds what issue 25 asked first: the stack, the FP8
per-GEMM table and a whole-model FP8 step, the CUDA AOTInductor export taken apart (preflight, a one-layer
smoke test, then ResNet-50 compile / load / parity each in its own process, a native backtrace under
cuda-gdb when the load dies) and the data path (20,000 generated JPEGs fed three ways). Part 2: the
user-facing commands end to end (torchcls export, serve, torchcls train with each --decode), FP8 rowwise
and the FSDP2 FP8 all-gather. Part 3: what the first H200 session measured already (DDP/FSDP2 over NCCL,
compile gains, bf16 training steps). Budgets are estimates from that session's timings where a step ran
then, and guesses where it did not (they are marked so in the step's text).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PART_BUDGET_S = {1: 480, 2: 540, 3: 540}  # part 1: 8 minutes; each part fits one 10-minute call with its start-up
JPEGS = 20000


@dataclass
class Ctx:
    out: Path
    py: str
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def torchcls(self, *args: str) -> list[str]:
        return [self.py, "-m", "torchcls", *args]

    def torchrun(self, *args: str) -> list[str]:
        return [self.py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "torchcls",
                *args]

    def script(self, name: str, *args: str) -> list[str]:
        return [self.py, str(HERE / name), *args]

    def step(self, name: str, *args: str, tag: str | None = None) -> list[str]:
        """A measurement of steps.py; it writes <tag or name>.json into the output folder."""
        return self.script("steps.py", name, "--json", str(self.out / f"{tag or name}.json"), *args)

    def diag(self, command: str, *args: str, tag: str | None = None) -> list[str]:
        return self.script("aoti_diag.py", command, "--json", str(self.out / f"{tag or 'aoti_' + command}.json"),
                           *args)

    def runs(self) -> Path:
        return self.out / "runs"


Commands = Callable[[Ctx], list[list[str]]]


@dataclass
class Step:
    name: str
    budget_s: int
    what: str
    commands: Commands
    needs: tuple[str, ...] = ()
    figures: Callable[[Ctx], dict[str, Any]] = lambda ctx: {}
    parts: tuple[int, ...] = (1,)  # env is in every part; a step another part needs is in both
    rehearsal: Commands | None = None  # the CPU stand-in; None: none exists (CUDA-only)
    only_if_failed: str = ""  # run only when this step failed (a diagnosis of it)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def step_json(name: str) -> Callable[[Ctx], dict[str, Any]]:
    return lambda ctx: _json(ctx.out / f"{name}.json")


def _table(ctx: Ctx) -> tuple[str, ...]:
    """--fp8-table for the whole-model FP8 step: the table part 1 just measured, when it wrote one."""
    table = ctx.out / "fp8_gemm.json"
    return ("--fp8-table", str(table)) if table.exists() and _json(table).get("gpu") not in (None, "cpu") else ()


TRAIN_DATA = ("--data", "mnist-5k", "--channels", "3", "--epochs", "1", "--workers", "8", "--no-progress")
CPU_RUN = ("--data", "mnist-5k", "--channels", "3", "--epochs", "1", "--workers", "0", "--no-progress",
           "--device", "cpu", "--precision", "fp32")


def artifact(ctx: Ctx) -> str:
    return str(ctx.out / "export" / "model.pt2")


def memory_commands(ctx: Ctx) -> list[list[str]]:
    return [ctx.torchcls("train", *TRAIN_DATA, "--model", "resnet50", "--img-size", "224", "--batch-size", "128",
                         "--precision", "bf16", "--device", "cuda", "--memory-report", "--memory-snapshot",
                         "--out-dir", str(ctx.runs()), "--name", "mem")]


def memory_rehearsal(ctx: Ctx) -> list[list[str]]:
    return [ctx.torchcls("train", *CPU_RUN, "--model", "resnet18", "--img-size", "32", "--batch-size", "128",
                         "--memory-report", "--memory-snapshot", "--out-dir", str(ctx.runs()), "--name", "mem")]


def diag_commands(command: str, device: str) -> Commands:
    ckpt = lambda c: ("--checkpoint", str(c.runs() / "mem"))  # noqa: E731
    sources = lambda c: ("--sources", str(c.out / "aoti"))  # noqa: E731
    if command == "compile":
        return lambda c: [c.diag("compile", *ckpt(c), "--artifact", artifact(c), *sources(c), "--device", device,
                                 "--max-batch", "64" if device == "cuda" else "8")]
    if command == "load":
        return lambda c: [c.diag("load", "--artifact", artifact(c), "--via", via, "--device", device,
                                 tag=f"aoti_load_{via}") for via in ("aoti", "torchcls")]
    if command == "parity":
        return lambda c: [c.diag("parity", *ckpt(c), "--artifact", artifact(c), "--device", device,
                                 "--images", "256" if device == "cuda" else "64")]
    return lambda c: [c.diag(command, *sources(c), "--device", device)]


def _parity_figures(ctx: Ctx) -> dict[str, Any]:
    p = _json(ctx.out / "export" / "parity.json")
    return {k: p.get(k) for k in ("device", "compute_capability", "gpu", "top1_agreement", "max_abs_diff", "n",
                                  "diagnosed_in")}


def _aoti_figures(ctx: Ctx) -> dict[str, Any]:
    compiled = _json(ctx.out / "aoti_compile.json")
    compiled.pop("package_files", None)
    return compiled


def _load_figures(ctx: Ctx) -> dict[str, Any]:
    return _json(ctx.out / "aoti_load_aoti.json") | _json(ctx.out / "aoti_load_torchcls.json")


def _memory_figures(ctx: Ctx) -> dict[str, Any]:
    report = _json(ctx.runs() / "mem" / "allocator.json")
    alloc = report.get("allocator", {})
    keys = ("allocated_peak_bytes", "reserved_peak_bytes", "fragmentation_pct_max", "num_alloc_retries", "num_ooms")
    snap = ctx.runs() / "mem" / "memory_snapshot.pickle"
    return {k: alloc.get(k) for k in keys} | {"snapshot_bytes": snap.stat().st_size if snap.exists() else None,
                                                "advice": alloc.get("advice")}


def _epochs(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    return [json.loads(x) for x in lines if '"kind": "epoch"' in x or '"kind":"epoch"' in x]


def _resume_figures(name: str) -> Callable[[Ctx], dict[str, Any]]:
    def figures(ctx: Ctx) -> dict[str, Any]:
        run = ctx.runs() / name
        epochs = [e for e in _epochs(run) if "val_top1" in e]
        return {"dcp": (run / "checkpoints" / "last.dcp").exists(), "epochs_recorded": len(epochs),
                "val_top1": [e.get("val_top1") for e in epochs]}
    return figures


def _decode_figures(ctx: Ctx) -> dict[str, Any]:
    """torchcls train's images/s per --decode: the second epoch's (the first includes the compile)."""
    rates = {}
    for decode in ("device", "workers"):
        epochs = _epochs(ctx.runs() / f"decode_{decode}")
        rates[decode] = round(epochs[-1]["img_per_s"], 1) if len(epochs) >= 2 else None
    return {"epoch2_images_per_s": rates, "data_feed_synthetic": _json(ctx.out / "data_feed.json").get("synthetic")}


def _serve_figures(ctx: Ctx) -> dict[str, Any]:
    s = _json(ctx.out / "serve_load.json")
    return {"raw_images_per_s": s.get("raw_images_per_s"), "best_fraction_of_raw": s.get("best_fraction_of_raw"),
            "levels": s.get("levels")}


# timm's published eager vs torch.compile gains (RTX 4090/5090, AMP, batch 1024), set beside ours: same
# backbones, another GPU and batch, so only the order of the gains compares.
TIMM_COMPILE_GAINS = {"resnet50": "1.87-1.95x", "convnext_tiny": "1.39-1.60x", "vit_base_patch16_224": "1.12-1.13x"}


def _median(v: Any) -> Any:
    return v.get("median") if isinstance(v, dict) else v


def _compile_figures(ctx: Ctx) -> dict[str, Any]:
    data = _json(ctx.out / "bench-compile" / "bench_compile.json")
    rows = [{"model": r.get("model"), "batch": r.get("batch"), "status": r.get("status"),
             "speedup": round(r["speedup"], 3) if r.get("speedup") else None,
             "eager_ms": _median(r.get("eager_ms")), "compiled_ms": _median(r.get("compiled_ms")),
             "timm_published": TIMM_COMPILE_GAINS.get(r.get("model")), "error": r.get("error")}
            for r in data.get("results", [])]
    return {"rows": rows}


def _fp8_table_figures(ctx: Ctx) -> dict[str, Any]:
    """The per-GEMM table in short: each measured layer's speed-up with casts, and the GEMMs' alone."""
    data = _json(ctx.out / "fp8_gemm.json")
    rows = data.get("rows", [])
    return {"gpu": data.get("gpu"), "shapes": len(rows) // 2,
            "linear_speedup": {f"{r['family']}.{r['layer']} M{r['m']} {r['recipe']}": r["linear_speedup"]
                               for r in rows if r.get("linear_speedup") is not None},
            "best_gemm_speedup": max((r["gemm_speedup"] for r in rows if r.get("gemm_speedup")), default=None)}


def _fp8_model(variants: str) -> Commands:
    return lambda c: [c.step("fp8", "--model", "vit_gigantic_patch14_224", "--depth", "4", "--batch", "64",
                             "--variants", variants, *_table(c), tag=f"fp8_{variants.split(',')[-1]}")]


def _fp8_rehearsal(variants: str) -> Commands:
    return lambda c: [c.step("fp8", "--device", "cpu", "--model", "vit_gigantic_patch14_224", "--depth", "1",
                             "--img-size", "28", "--batch", "2", "--steps", "2", "--warmup", "1", "--variants", variants,
                             "--fp8-emulate", "--fp8-min-dim", "256", tag=f"fp8_{variants.split(',')[-1]}")]


def _decode_run(c: Ctx, decode: str, device: str = "cuda") -> list[str]:
    size, batch, workers, epochs = ("224", "256", "15", "2") if device == "cuda" else ("192", "8", "2", "2")
    model = "resnet50" if device == "cuda" else "resnet18"
    return c.torchcls("train", "--data", str(c.out / "jpegs"), "--model", model, "--img-size", size, "--batch-size",
                      batch, "--epochs", epochs, "--augment", "standard", "--precision", "bf16" if device == "cuda"
                      else "fp32", "--compile", "--channels-last", "--in-memory", "off", "--workers", workers,
                      "--val-fraction", "0.02", "--decode", decode, "--device", device, "--no-progress", "--out-dir",
                      str(c.runs()), "--name", f"decode_{decode}")


def _jpegs(n: int) -> Commands:
    return lambda c: [c.script("make_jpegs.py", str(c.out / "jpegs"), "--images", str(n),
                               "--classes", "100" if n >= 1000 else "10")]


STEPS = [
    Step("env", 20, "torch, CUDA, GPU name and compute capability", lambda c: [c.step("env")],
         figures=step_json("env"), parts=(1, 2, 3), rehearsal=lambda c: [c.step("env", "--device", "cpu")]),
    # -- part 1: FP8 where it can pay, the CUDA export taken apart, the data path
    Step("preflight", 10, "what AOTInductor's CUDA build needs: CUDA_HOME, nvcc, cuda.h, libcuda, the host compiler",
         lambda c: [c.diag("preflight")], figures=step_json("aoti_preflight"),
         rehearsal=lambda c: [c.diag("preflight", "--device", "cpu")]),
    Step("fp8_gemm", 60, "bf16 mm vs _scaled_mm e4m3 (tensorwise, rowwise) per GEMM of ViT-H/giant/gigantic layers and "
         "8192^3, without casts; the layers with casts, compiled, at batch 64 until 40 s are spent (budget guessed)",
         lambda c: [c.script("fp8_gemm.py", "--json", str(c.out / "fp8_gemm.json"), "--budget-s", "40")],
         figures=_fp8_table_figures,
         rehearsal=lambda c: [c.script("fp8_gemm.py", "--json", str(c.out / "fp8_gemm.json"), "--dry-run",
                                       "--device", "cpu", "--reps", "3")]),
    Step("fp8", 65, "vit_gigantic_patch14_224 (4 blocks, batch 64) training step, whole model compiled: bf16 vs FP8 "
         "tensorwise on the layers the rule chooses from fp8_gemm's table (budget guessed)",
         _fp8_model("bf16,fp8-tensorwise"), figures=step_json("fp8_fp8-tensorwise"),
         rehearsal=_fp8_rehearsal("bf16,fp8-tensorwise")),
    Step("memory_report", 30, "torchcls train --memory-report --memory-snapshot (ResNet-50, bf16): allocator report, "
         "and the checkpoint the export steps use", memory_commands, figures=_memory_figures, parts=(1, 2),
         rehearsal=memory_rehearsal),
    Step("aoti_smoke", 40, "a one-layer model (conv, BN, linear) through AOTInductor on CUDA, with and without "
         "freezing, each package loaded in a fresh process and in its own (budget guessed)",
         diag_commands("smoke", "cuda"), figures=step_json("aoti_smoke"), rehearsal=diag_commands("smoke", "cpu")),
    Step("aoti_compile", 110, "ResNet-50: torchcls's capture and AOTInductor CUDA build in one process; generated "
         "sources kept (aoti/aoti_sources.tar.gz)", diag_commands("compile", "cuda"), needs=("memory_report",),
         figures=_aoti_figures, rehearsal=diag_commands("compile", "cpu")),
    Step("aoti_load", 25, "the package in fresh processes: AOTInductor's loader and a batch on the GPU, then "
         "torchcls's loader and a host batch", diag_commands("load", "cuda"), needs=("aoti_compile",),
         figures=_load_figures, rehearsal=diag_commands("load", "cpu")),
    Step("aoti_backtrace", 45, "only when aoti_load failed: the load under cuda-gdb, for a native backtrace",
         lambda c: [c.diag("backtrace", "--artifact", artifact(c))], figures=step_json("aoti_backtrace"),
         only_if_failed="aoti_load"),
    Step("aoti_parity", 25, "eager vs the package on 256 held-out images in a fresh process: parity.json",
         diag_commands("parity", "cuda"), needs=("aoti_load",), figures=_parity_figures,
         rehearsal=diag_commands("parity", "cpu")),
    Step("jpeg_data", 20, f"{JPEGS:,} generated photo-like JPEGs of about 500x375 in 100 class folders", _jpegs(JPEGS),
         figures=lambda c: _json(c.out / "jpegs.json"), parts=(1, 2), rehearsal=_jpegs(200)),
    Step("data_feed", 75, "ResNet-50 bf16 compiled, batch 256: images/s on synthetic batches, with torchcls's feed "
         "decoding on the GPU, and decoding in 15 workers; one process (budget guessed)",
         lambda c: [c.script("data_feed.py", "--data", str(c.out / "jpegs"), "--json", str(c.out / "data_feed.json"))],
         needs=("jpeg_data",), figures=step_json("data_feed"),
         rehearsal=lambda c: [c.script("data_feed.py", "--data", str(c.out / "jpegs"), "--json",
                                       str(c.out / "data_feed.json"), "--device", "cpu", "--model", "resnet18",
                                       "--img-size", "192", "--batch", "8", "--steps", "3", "--warmup", "1",
                                       "--workers", "2")]),
    # -- part 2: the user-facing commands end to end, FP8 rowwise, FSDP2 FP8 all-gather
    Step("export_aoti_cuda", 120, "torchcls export --target aoti --device cuda of the ResNet-50 run, parity.json",
         lambda c: [c.torchcls("export", str(c.runs() / "mem"), "--target", "aoti", "--device", "cuda",
                               "--max-batch", "64", "--parity-images", "256", "--min-agreement", "0.99",
                               "--out", str(c.out / "export-cli" / "model.pt2"))],
         needs=("memory_report",), figures=lambda c: _json(c.out / "export-cli" / "parity.json"), parts=(2,)),
    Step("inference_bench", 40, "the CUDA .pt2 vs eager vs torch.compile: b1 latency, b64 throughput",
         lambda c: [c.step("infer", "--artifact", str(c.out / "export-cli" / "model.pt2"), "--checkpoint",
                           str(c.runs() / "mem"))], needs=("export_aoti_cuda",), figures=step_json("infer"), parts=(2,)),
    Step("serve_throughput", 30, "torchcls serve of the CUDA .pt2 (auto device) vs the raw artifact, images/s",
         lambda c: [[c.py, str(REPO / "benchmarks" / "serve_load.py"), str(c.out / "export-cli" / "model.pt2"),
                     "--concurrency", "32", "--seconds", "5", "--rounds", "1", "--max-batch", "64",
                     "--json-out", str(c.out / "serve_load.json")]],
         needs=("export_aoti_cuda",), figures=_serve_figures, parts=(2,)),
    Step("decode_train", 150, "torchcls train on the JPEGs (ResNet-50 bf16 compiled, batch 256, 2 epochs) with "
         "--decode device, then --decode workers: the second epoch's images/s (budget guessed)",
         lambda c: [_decode_run(c, "device"), _decode_run(c, "workers")], needs=("jpeg_data",),
         figures=_decode_figures, parts=(2,), rehearsal=lambda c: [_decode_run(c, d, "cpu") for d in ("device", "workers")]),
    Step("fp8_rowwise", 70, "as fp8, with FP8 rowwise (no per-GEMM table in this call: the roofline rule)",
         _fp8_model("bf16,fp8-rowwise"), figures=step_json("fp8_fp8-rowwise"), parts=(2,),
         rehearsal=_fp8_rehearsal("bf16,fp8-rowwise")),
    Step("fp8_fsdp_all_gather", 50, "torchrun FSDP2 with --precision fp8 --fp8-fsdp-all-gather, world size 1",
         lambda c: [c.torchrun("train", *TRAIN_DATA, "--model", "vit_small_patch16_224", "--img-size", "64",
                               "--parallel", "fsdp2", "--precision", "fp8", "--fp8-recipe", "tensorwise",
                               "--fp8-fsdp-all-gather", "--fp8-min-dim", "256", "--out-dir", str(c.runs()),
                               "--name", "fp8fsdp")], figures=_resume_figures("fp8fsdp"), parts=(2,),
         rehearsal=lambda c: [c.torchrun("train", *CPU_RUN[:-2], "--model", "vit_small_patch16_224", "--img-size", "32",
                                         "--parallel", "fsdp2", "--precision", "fp8", "--fp8-emulate", "--fp8-recipe",
                                         "tensorwise", "--fp8-fsdp-all-gather", "--fp8-min-dim", "256", "--out-dir",
                                         str(c.runs()), "--name", "fp8fsdp")]),
    # -- part 3: measured in the first H200 session already
    Step("ddp_nccl", 55, "torchrun --nproc-per-node 1 DDP over NCCL, then --resume for a second epoch",
         lambda c: [c.torchrun("train", *TRAIN_DATA, "--model", "resnet18", "--img-size", "64", "--parallel", "ddp",
                               "--precision", "bf16", "--out-dir", str(c.runs()), "--name", "ddp"),
                    c.torchrun("train", *TRAIN_DATA[:-3], "--workers", "8", "--no-progress", "--epochs", "2",
                               "--model", "resnet18", "--img-size", "64", "--parallel", "ddp", "--precision", "bf16",
                               "--out-dir", str(c.runs()), "--name", "ddp", "--resume")],
         figures=_resume_figures("ddp"), parts=(3,)),
    Step("fsdp2_nccl_dcp", 80, "torchrun FSDP2 over NCCL, DCP save, --resume, consolidate",
         lambda c: [*(c.torchrun("train", *TRAIN_DATA[:-3], "--workers", "8", "--no-progress", "--epochs", str(e),
                                 "--model", "vit_small_patch16_224", "--img-size", "64", "--parallel", "fsdp2",
                                 "--precision", "bf16", "--out-dir", str(c.runs()), "--name", "fsdp2",
                                 *(("--resume",) if e == 2 else ())) for e in (1, 2)),
                    c.torchcls("consolidate", str(c.runs() / "fsdp2"))],
         figures=_resume_figures("fsdp2"), parts=(3,)),
    Step("bench_compile", 190, "torchcls bench compile: resnet50, convnext_tiny, vit_base_patch16_224 at bf16, b64",
         lambda c: [c.torchcls("bench", "compile", "--models", "resnet50,convnext_tiny,vit_base_patch16_224",
                               "--batch", "64", "--precision", "bf16", "--modes", "default", "--device", "cuda",
                               "--repeats", "10", "--timeout", "60", "--out", str(c.out / "bench-compile"))],
         figures=_compile_figures, parts=(3,)),
    Step("train_resnet50", 75, "ResNet-50 training step, bf16 autocast, eager vs torch.compile, images/s",
         lambda c: [c.step("train", "--model", "resnet50", "--batch", "128", tag="train_resnet50")],
         figures=step_json("train_resnet50"), parts=(3,)),
    Step("train_vit", 55, "ViT-B/16 training step, bf16 autocast, eager vs torch.compile, images/s",
         lambda c: [c.step("train", "--model", "vit_base_patch16_224", "--batch", "128", tag="train_vit")],
         figures=step_json("train_vit"), parts=(3,)),
]

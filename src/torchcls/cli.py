"""The `torchcls` command: parses, calls one public function per command, prints.

Training flags are generated from the config dataclasses (torchcls.config), so every
option and its help text is declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from torchcls.config import SECTIONS, Config, field_type, load_toml, set_option
from torchcls.errors import UserError


def _flag(f: dataclasses.Field) -> str:
    return "--" + (f.metadata.get("flag") or f.name).replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="load options from a TOML file; flags override it")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}] options")
        for f in dataclasses.fields(cls):
            t = field_type(f)
            default = f.default
            help_text = f.metadata["help"] + ("" if default is None else f" (default: {default})")
            kwargs = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS, help=help_text)
            if t is bool:
                group.add_argument(_flag(f), action=argparse.BooleanOptionalAction, **kwargs)
            else:
                group.add_argument(_flag(f), type=t, choices=f.metadata.get("choices"),
                                   metavar=None if f.metadata.get("choices") else f.name.upper(), **kwargs)


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = load_toml(args.config) if args.config else Config()
    for dest, value in vars(args).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            set_option(cfg, section, key, value, origin="command line")
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    from torchcls.training import train

    result = train(config_from_args(args))
    if result.interrupted:
        return 130
    print(f"run dir: {result.run_dir}\nbest checkpoint: {result.best_checkpoint}\nreport: "
          f"{result.run_dir / 'report.html'}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from torchcls.evaluation import evaluate

    r = evaluate(args.checkpoint, data=args.data, root=args.root, split=args.split, out_dir=args.out,
                 batch_size=args.batch_size, workers=args.workers, device=args.device, on_bad_file=args.on_bad_file,
                 threshold=args.threshold, target_accuracy=args.target_accuracy, target_compute=args.target_compute)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{r['data']} [{r['split']}]: top1 {r['top1']:.4f}  top5 {r['top5']:.4f}  n {r['n']}  "
              f"macro-F1 {r['macro_f1']:.4f}  ECE {r['ece']:.4f}\nwrote {Path(r['out_dir']) / 'eval.json'}")
        if "early_exit" in r:
            ee = r["early_exit"]
            print(f"early exit: threshold {ee['threshold']:.4g}  accuracy {ee['accuracy']:.4f} (backbone "
                  f"{ee['backbone_accuracy']:.4f})  exits {' / '.join(f'{f:.1%}' for f in ee['exit_fractions'])}  "
                  f"{ee['mean_flops'] / 1e6:.2f} MFLOP/image ({ee['relative_compute']:.0%} of the backbone)  "
                  f"{ee['latency_ms_per_sample']:.2f} ms/image (backbone {ee['backbone_latency_ms_per_sample']:.2f})")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from torchcls.prediction import predict

    preds = predict(args.checkpoint, args.images, topk=args.topk, device=args.device, on_bad_file=args.on_bad_file)
    if args.json:
        print(json.dumps({"predictions": preds.items, "skipped": preds.skipped}, indent=2))
        return 0
    from rich.table import Table

    from torchcls.console import console

    table = Table("file", "label", "probability", *(f"#{i}" for i in range(2, args.topk + 1)))
    for item in preds.items:
        top = item["top"]
        table.add_row(item["file"], top[0]["label"], f"{top[0]['prob']:.3f}",
                      *(f"{t['label']} {t['prob']:.3f}" for t in top[1:]))
    console.print(table)
    for s in preds.skipped:
        console.print(f"[yellow]skipped {s['file']}: {s['reason']}[/]")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from torchcls.explain import explain

    for e in explain(args.checkpoint, args.images, method=args.method, target=args.target, out_dir=args.out,
                     steps=args.steps, on_bad_file=args.on_bad_file):
        where = f" (exit {e.exit})" if e.exit is not None else ""
        print(f"{e.file}: {e.label} {e.prob:.3f}{where} -> {e.png}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from torchcls.artifacts import export

    r = export(args.checkpoint, target=args.target, precision=args.precision, max_batch=args.max_batch,
               out=args.out, min_agreement=args.min_agreement, parity_images=args.parity_images,
               data=args.data, root=args.root, quantize=args.quantize, backend=args.backend,
               calibration_images=args.calibration_images)
    p = r.parity
    print(f"wrote {r.path} ({r.path.stat().st_size / 1e6:.1f} MB, {r.info.target} {r.info.precision}, batch 1-"
          f"{r.info.max_batch})\nparity on {p['n']} held-out images: top-1 agreement {p['top1_agreement']:.4f}, "
          f"max |dlogit| {p['max_abs_diff']:.3g} -> {r.parity_path}")
    if "executorch" in p:
        from torchcls.artifacts.edge import describe

        print(describe(p))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from torchcls.demo import demo

    demo(out_dir=args.out_dir, name=args.name, epochs=args.epochs)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from torchcls.serve import ServeConfig, serve

    options = {k.removeprefix("serve."): v for k, v in vars(args).items() if k.startswith("serve.")}
    serve(args.artifact, ServeConfig(**options))
    return 0


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from torchcls.serve.config import ServeConfig, field_types

    types_ = field_types()
    for f in dataclasses.fields(ServeConfig):
        p.add_argument(_flag(f), dest=f"serve.{f.name}", type=types_[f.name], default=f.default,
                       metavar=f.name.upper(), help=f.metadata["help"] + ("" if f.default is None else
                                                                           f" (default: {f.default})"))


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from torchcls.checkpoint.dcp import consolidate

    print(f"wrote {consolidate(args.checkpoint, args.out)}")
def _cmd_audit_kernels(args: argparse.Namespace) -> int:
    from torchcls.audit.kernels import audit_kernels, default_out, to_markdown, write_audit

    audit = audit_kernels(args.imports or [], model=args.model, namespaces=args.namespaces)
    json_path, _ = write_audit(audit, Path(args.out) if args.out else default_out(args.model))
    result = audit.as_dict()
    print(json.dumps(result, indent=2) if args.json else to_markdown(result) + f"\nwrote {json_path}")
    return 0 if result["passed"] else 1


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _cmd_bench_compile(args: argparse.Namespace) -> int:
    from torchcls.bench.compile import BenchCompileConfig, bench_compile

    try:
        batches = [int(b) for b in _csv(args.batch)]
    except ValueError:
        raise UserError(f"--batch must be comma-separated integers, got {args.batch!r}") from None
    cfg = BenchCompileConfig(_csv(args.models), batches, _csv(args.precision), _csv(args.modes), args.device,
                             args.img_size, args.repeats, args.timeout)
    data = bench_compile(cfg, args.out)
    from torchcls.bench.compile import to_markdown

    print(to_markdown(data) + f"\nwrote {Path(args.out) / 'bench_compile.json'}")
    return 0


def _cmd_bench_memory(args: argparse.Namespace) -> int:
    from torchcls.bench.memory import BenchMemoryConfig, bench_memory, to_markdown
    from torchcls.bench.memory_fit import parse_size

    try:
        worlds = [int(w) for w in _csv(args.world_sizes)]
    except ValueError:
        raise UserError(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}") from None
    device_memory = [parse_size(s, "--device-memory") for s in _csv(args.device_memory)] if args.device_memory else None
    cfg = BenchMemoryConfig(args.model, _csv(args.parallel), worlds, device_memory, args.batch, args.img_size,
                            args.steps, parse_size(args.overhead, "--overhead"), args.timeout)
    data = bench_memory(cfg, args.out)
    print(to_markdown(data) + f"\nwrote {Path(args.out) / 'bench_memory.json'}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from torchcls.report.html import build_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory: pass a run dir (runs/<name>) or a results folder")
    path, sections = build_report(run_dir)
    for _key, title, body in sections:
        print(f"{title:<22} {'included' if body is not None else 'not run'}")
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchcls", description="PyTorch-native image classification: "
                                     "train, evaluate and predict on real images.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a model; writes runs/<name>/", description="Train a model. Options "
                       "come from --config FILE.toml (sections [data] [model] [optim] [train] [run]) and flags.")
    add_config_flags(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("evaluate", help="evaluate a checkpoint; writes eval.json and a confusion matrix",
                       description="Evaluate a checkpoint on its held-out data (or other data).")
    p.add_argument("checkpoint", help="a .safetensors checkpoint or a run dir (uses its best checkpoint)")
    p.add_argument("--data", help="evaluate on other data (built-in name, ImageFolder dir or CSV) instead of "
                   "the training data's held-out split")
    p.add_argument("--root", help="fashion-mnist directory, or base for relative CSV paths")
    p.add_argument("--split", choices=("val", "test", "train", "all"),
                   help="which part of the data (default: test for fashion-mnist, else val)")
    p.add_argument("--out", help="write eval.json here (default: the checkpoint's run dir)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--threshold", type=float, help="early-exit models: exit confidence threshold in [0, 1] "
                   "(default: the one it was trained with)")
    p.add_argument("--target-accuracy", type=float, help="early-exit models: calibrate the threshold on the "
                   "validation split: the cheapest one reaching this accuracy (e.g. 0.9)")
    p.add_argument("--target-compute", type=float, help="early-exit models: calibrate the threshold on the "
                   "validation split: the most accurate one whose mean FLOPs stay within this fraction of the "
                   "backbone's (e.g. 0.7)")
    _add_runtime_flags(p)
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("predict", help="classify image files or folders", description="Top-k labels for images.")
    p.add_argument("checkpoint", help="a .safetensors checkpoint, a run dir, or an exported .pt2/.onnx artifact")
    p.add_argument("images", nargs="+", help="image files and/or folders (searched recursively)")
    p.add_argument("--topk", type=int, default=3, help="how many labels per image (default: 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_runtime_flags(p, batch=False)
    p.set_defaults(func=_cmd_predict)

    p = sub.add_parser("explain", help="attribution maps: which pixels drove a prediction (PNG overlays)",
                       description="Attribution maps with captum for a checkpoint (plain or early-exit model).")
    p.add_argument("checkpoint", help="a .safetensors checkpoint or a run dir")
    p.add_argument("images", nargs="+", help="image files and/or folders (searched recursively)")
    p.add_argument("--method", choices=("integrated-gradients", "saliency"), default="integrated-gradients",
                   help="attribution method (default: integrated-gradients)")
    p.add_argument("--target", help="class to explain (default: the predicted one)")
    p.add_argument("--steps", type=int, default=32, help="integrated-gradients steps (default: 32)")
    p.add_argument("--out", help="folder for the PNGs (default: <run dir>/explain)")
    p.add_argument("--on-bad-file", choices=("error", "skip"), default="error",
                   help="unreadable images: stop with an error (default) or skip them")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("export", help="export a checkpoint to an AOTInductor package or ONNX, verified "
                       "against eager", description="Export a checkpoint (torch.export with a dynamic batch "
                       "dimension) to an AOTInductor .pt2 package or an ONNX model that carries its class names "
                       "and preprocessing, check it against eager on held-out images (parity.json beside it) "
                       "and refuse to write it when top-1 agreement is below --min-agreement.")
    p.add_argument("checkpoint", help="a .safetensors checkpoint or a run dir")
    p.add_argument("--target", choices=("aoti", "onnx", "executorch"), default="aoti", help="aoti: .pt2 "
                   "AOTInductor package (runs from Python with torch only, or C++); onnx: ONNX Runtime; "
                   "executorch: .pte program for the ExecuTorch runtime on devices (default: aoti)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="weights and compute inside "
                   "the artifact; inputs and logits stay float32 (default: fp32; bf16 for aoti only)")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch the artifact accepts (default: 64)")
    p.add_argument("--out", help="artifact path (.pt2/.onnx) or folder (default: "
                   "<run dir>/export/<target>-<precision>/model.<ext>); parity.json goes beside it")
    p.add_argument("--min-agreement", type=float, default=None, help="least top-1 agreement with eager for the "
                   "export to succeed (default: 0.999 for fp32, 0.99 for bf16)")
    p.add_argument("--parity-images", type=int, default=500, help="held-out images for parity (default: 500)")
    p.add_argument("--data", help="take parity images from this data (same classes) instead of the "
                   "checkpoint's held-out split")
    p.add_argument("--root", help="fashion-mnist directory, or base for relative CSV paths")
    p.add_argument("--quantize", choices=("none", "int8"), default=None, help="executorch: int8 weights and "
                   "activations (PT2E, XNNPACK quantizer, per-channel), calibrated on training images "
                   "(default: none)")
    p.add_argument("--backend", choices=("xnnpack", "portable"), default=None, help="executorch: delegate to "
                   "XNNPACK, or portable kernels only (default: xnnpack)")
    p.add_argument("--calibration-images", type=int, default=None, help="executorch int8: training images "
                   "used to calibrate activation ranges (default: up to 256, at least 16)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("demo", help="train the built-in net on mnist-5k, evaluate and report",
                       description="The end-to-end demo: a real model on real digits in a few minutes on a CPU.")
    p.add_argument("--out-dir", default="runs", help="parent of the run dir (default: runs)")
    p.add_argument("--name", default="demo", help="run name (default: demo; an old demo run is replaced)")
    p.add_argument("--epochs", type=int, default=None, help="override the demo's epoch count")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("serve", help="serve an artifact over HTTP (Open Inference Protocol v2 and /predict)",
                       description="An HTTP inference server with dynamic batching, a bounded queue and "
                       "Prometheus /metrics. Ctrl-C / SIGTERM answers the accepted requests, then exits.")
    p.add_argument("artifact", help="a .pt2 / .onnx artifact from `torchcls export`, a .safetensors checkpoint "
                   "or a run dir")
    add_serve_flags(p)
    p.set_defaults(func=_cmd_serve)

    from torchcls.governance.cli import add_governance_commands

    add_governance_commands(sub)  # data manifest, verify, lineage
    p = sub.add_parser("consolidate", help="merge a sharded (DCP) checkpoint into one safetensors file",
                       description="Load a torch.distributed.checkpoint written by any number of ranks into one "
                       "process and write a single safetensors file (for evaluate, predict, export).")
    p.add_argument("checkpoint", help="a run dir (uses checkpoints/last.dcp) or a DCP checkpoint dir")
    p.add_argument("--out", help="output .safetensors (default: checkpoints/consolidated.safetensors)")
    p.set_defaults(func=_cmd_consolidate)
    audit = sub.add_parser("audit", help="audits: custom kernels (torchcls audit kernels)").add_subparsers(
        dest="audit_command", required=True, metavar="AUDIT")
    p = audit.add_parser("kernels", help="custom ops, fake impls, opcheck, GPU archs of extensions, Triton kernels",
                         description="Audit custom operators (dispatch keys, fake impl, autograd, opcheck), the GPU "
                         "architectures compiled extensions target, Triton kernels, and the custom ops a model's "
                         "exported graph calls. Exit code 1 when a check fails (for CI).")
    p.add_argument("--import", dest="imports", action="append", metavar="PKG",
                   help="import this package first (it registers the ops); repeatable")
    p.add_argument("--model", metavar="CHECKPOINT_OR_NAME", help="a checkpoint or run dir, a model name, or "
                   "package.module:factory returning a module (or (module, example_input)); its exported graph "
                   "is searched for custom ops")
    p.add_argument("--namespace", dest="namespaces", action="append", metavar="NS",
                   help="audit only this op namespace (default: those the imports register, else all non-PyTorch)")
    p.add_argument("--out", help="write kernel_audit.json/.md here (default: the run dir of --model, else "
                   "./kernel-audit)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_cmd_audit_kernels)

    bench = sub.add_parser("bench", help="benchmarks: torch.compile gains, memory when scaling (torchcls bench compile|memory)").add_subparsers(
        dest="bench_command", required=True, metavar="BENCH")
    p = bench.add_parser("compile", help="eager vs torch.compile per backbone, batch, precision and mode",
                         description="Latency/throughput of eager vs compiled inference, cold compile time, graph "
                         "breaks with reasons, recompiles over batch sizes, parity and peak memory; each "
                         "configuration in its own process. Writes bench_compile.json/.md/.png.")
    p.add_argument("--models", required=True, help="comma-separated model names (timm, tv/..., smallnet), "
                   "checkpoints, or package.module:factory")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    p.add_argument("--precision", default="fp32", help="comma-separated: fp32, bf16 (autocast) (default: fp32)")
    p.add_argument("--modes", default="default", help="comma-separated torch.compile modes (default: default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--img-size", type=int, default=None, help="input size (default: 224; 28 for smallnet)")
    p.add_argument("--repeats", type=int, default=10, help="interleaved timed calls per side (default: 10)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration before it is recorded "
                   "as failed (default: 1800)")
    p.add_argument("--out", default="bench-compile", help="output folder; a run dir puts the results in its "
                   "report (default: ./bench-compile)")
    p.set_defaults(func=_cmd_bench_compile)
    p = bench.add_parser("memory", help="per-rank memory of DDP/FSDP2 training over world sizes, and what fits",
                         description="Real torchrun jobs per (parallel, world size): per-rank parameter, gradient, "
                         "optimizer, activation and peak memory next to the analytic model; for the cluster "
                         "given by --device-memory, which ranks limit the batch and what per-rank batch or "
                         "sharding fits. Writes bench_memory.json/.md/.png.")
    p.add_argument("--model", required=True, help="model name (timm, tv/..., smallnet), random init")
    p.add_argument("--parallel", default="ddp,fsdp2", help="comma-separated: ddp, fsdp2 (default: ddp,fsdp2)")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated ranks per job (default: 1,2)")
    p.add_argument("--device-memory", help="memory per rank, in rank order, e.g. 80GiB,40GiB (a shorter list "
                   "repeats: 80GiB,40GiB at 4 ranks is 80,40,80,40); more entries than the largest world size "
                   "adds a projection to that many ranks (default: this machine's GPU, or its RAM / ranks)")
    p.add_argument("--batch", type=int, default=2, help="images per rank in the measured steps (default: 2)")
    p.add_argument("--img-size", type=int, default=None, help="input size (default: 224; 28 for smallnet)")
    p.add_argument("--steps", type=int, default=2, help="training steps per job (default: 2)")
    p.add_argument("--overhead", default="1GiB", help="allowance per rank for the runtime, CUDA context and "
                   "workspaces in the fit (default: 1GiB)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per job before it is recorded as failed "
                   "(default: 1800)")
    p.add_argument("--out", default="bench-memory", help="output folder; a run dir puts the results in its "
                   "report (default: ./bench-memory)")
    p.set_defaults(func=_cmd_bench_memory)

    p = sub.add_parser("report", help="(re)write RUN_DIR/report.html from every result found in the run dir",
                       description="One HTML page with the run's training, evaluation, exports/parity, compile "
                       "gains, memory and kernel-audit results (each section says 'not run' when absent).")
    p.add_argument("run_dir", help="a run dir (runs/<name>) or any folder of results")
    p.set_defaults(func=_cmd_report)
    return parser


def _add_runtime_flags(p: argparse.ArgumentParser, batch: bool = True) -> None:
    if batch:
        p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default: 256)")
        p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default: 2)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--on-bad-file", choices=("error", "skip"), default="error",
                   help="unreadable images: stop with an error (default) or skip and list them")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"torchcls {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())

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
    from torchcls.train import train

    result = train(config_from_args(args))
    if result.interrupted:
        return 130
    print(f"run dir: {result.run_dir}\nbest checkpoint: {result.best_checkpoint}\nreport: "
          f"{result.run_dir / 'report.html'}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from torchcls.evaluate import evaluate

    r = evaluate(args.checkpoint, data=args.data, root=args.root, split=args.split, out_dir=args.out,
                 batch_size=args.batch_size, workers=args.workers, device=args.device, on_bad_file=args.on_bad_file)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{r['data']} [{r['split']}]: top1 {r['top1']:.4f}  top5 {r['top5']:.4f}  n {r['n']}  "
              f"macro-F1 {r['macro_f1']:.4f}  ECE {r['ece']:.4f}\nwrote {Path(r['out_dir']) / 'eval.json'}")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from torchcls.predict import predict

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


def _cmd_export(args: argparse.Namespace) -> int:
    from torchcls.export import export

    r = export(args.checkpoint, target=args.target, precision=args.precision, max_batch=args.max_batch,
               out=args.out, min_agreement=args.min_agreement, parity_images=args.parity_images,
               data=args.data, root=args.root, quantize=args.quantize, backend=args.backend,
               calibration_images=args.calibration_images)
    p = r.parity
    print(f"wrote {r.path} ({r.path.stat().st_size / 1e6:.1f} MB, {r.info.target} {r.info.precision}, batch 1-"
          f"{r.info.max_batch})\nparity on {p['n']} held-out images: top-1 agreement {p['top1_agreement']:.4f}, "
          f"max |dlogit| {p['max_abs_diff']:.3g} -> {r.parity_path}")
    if "executorch" in p:
        from torchcls.export.edge import describe

        print(describe(p))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from torchcls.demo import demo

    demo(out_dir=args.out_dir, name=args.name, epochs=args.epochs)
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
    _add_runtime_flags(p)
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("predict", help="classify image files or folders", description="Top-k labels for images.")
    p.add_argument("checkpoint", help="a .safetensors checkpoint or a run dir")
    p.add_argument("images", nargs="+", help="image files and/or folders (searched recursively)")
    p.add_argument("--topk", type=int, default=3, help="how many labels per image (default: 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_runtime_flags(p, batch=False)
    p.set_defaults(func=_cmd_predict)

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

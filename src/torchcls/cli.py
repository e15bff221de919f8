"""The `torchcls` command: parses, calls one public function per command, prints.

Flags are generated from typed options declared once: the training config (torchcls.config) for
`train`, torchcls.options for the other commands, torchcls.serve.serve_config for `serve`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchcls import options as o
from torchcls.cli_output import version_line
from torchcls.config import SECTIONS
from torchcls.errors import UserError
from torchcls.options import add_config_flags, config_from_args  # noqa: F401  (config_from_args: public)


def _cmd_train(args: argparse.Namespace) -> int:
    from torchcls.training import train

    if args.recipe == "list":  # show the named recipes instead of training
        from torchcls.recipes import describe

        print(describe())
        return 0
    result = train(config_from_args(args))
    if result.interrupted:
        return 130
    print(f"run dir: {result.run_dir}\nbest checkpoint: {result.best_checkpoint}\nreport: "
          f"{result.run_dir / 'report.html'}")
    return 0


def _cmd_evaluate(opts: o.EvaluateOptions) -> int:
    from torchcls.cli_output import evaluation_lines
    from torchcls.evaluation import evaluate

    r = evaluate(opts.checkpoint, out_dir=opts.out, **o.kwargs_of(opts, "checkpoint", "out", "json"))
    print(json.dumps(r, indent=2) if opts.json else "\n".join(evaluation_lines(r)))
    return 0


def _cmd_predict(opts: o.PredictOptions) -> int:
    from torchcls.cli_output import print_predictions
    from torchcls.prediction import predict

    preds = predict(opts.checkpoint, opts.images, **o.kwargs_of(opts, "checkpoint", "images", "json"))
    if opts.json:
        print(json.dumps({"predictions": preds.items, "skipped": preds.skipped}, indent=2))
    else:
        print_predictions(preds, opts.topk)
    return 0


def _cmd_explain(opts: o.ExplainOptions) -> int:
    from torchcls.explain import explain

    for e in explain(opts.checkpoint, opts.images, out_dir=opts.out, **o.kwargs_of(opts, "checkpoint", "images",
                                                                                  "out")):
        where = f" (exit {e.exit})" if e.exit is not None else ""
        print(f"{e.file}: {e.label} {e.prob:.3f}{where} -> {e.png}")
    return 0


def _cmd_export(opts: o.ExportOptions) -> int:
    from torchcls.artifacts import export
    from torchcls.cli_output import export_lines
    from torchcls.console import phases

    with phases("export"):  # on a terminal: which phase is running and for how long (a build takes 20-80 s)
        r = export(opts.checkpoint, **o.kwargs_of(opts, "checkpoint"))
    print("\n".join(export_lines(r)))
    return 0


def _cmd_demo(opts: o.DemoOptions) -> int:
    from torchcls.demo import demo

    demo(**o.kwargs_of(opts))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from torchcls.serve import ServeConfig, serve

    serve(args.artifact, ServeConfig(**{k.removeprefix("serve."): v for k, v in vars(args).items()
                                        if k.startswith("serve.")}))
    return 0


def _cmd_consolidate(opts: o.ConsolidateOptions) -> int:
    from torchcls.checkpoint.consolidate import consolidate

    print(f"wrote {consolidate(opts.checkpoint, **o.kwargs_of(opts, 'checkpoint'))}")
    return 0


def _cmd_audit_kernels(opts: o.AuditKernelsOptions) -> int:
    from torchcls.kernel_audit.kernels import audit_kernels, default_out, to_markdown, write_audit

    audit = audit_kernels(opts.imports or [], model=opts.model, namespaces=opts.namespaces)
    json_path, _ = write_audit(audit, Path(opts.out) if opts.out else default_out(opts.model))
    result = audit.as_dict()
    print(json.dumps(result, indent=2) if opts.json else to_markdown(result) + f"\nwrote {json_path}")
    return 0 if result["passed"] else 1


def _cmd_bench_compile(opts: o.BenchCompileOptions) -> int:
    from torchcls.suite.compile_gains import bench_compile, config_from, to_markdown

    data = bench_compile(config_from(opts), opts.out)
    print(to_markdown(data) + f"\nwrote {Path(opts.out) / 'bench_compile.json'}")
    return 0


def _cmd_bench_memory(opts: o.BenchMemoryOptions) -> int:
    from torchcls.suite.memory_scaling import bench_memory, config_from, to_markdown

    data = bench_memory(config_from(opts), opts.out)
    print(to_markdown(data) + f"\nwrote {Path(opts.out) / 'bench_memory.json'}")
    return 0


def _cmd_shard(opts: o.ShardOptions) -> int:
    from torchcls.data.shards import parse_size, write_shards
    from torchcls.data.sources import open_source

    images = open_source(opts.source, opts.root, opts.split, opts.channels, opts.on_bad_file)
    shards = write_shards(images, opts.out, parse_size(opts.shard_size), prefix=opts.split, seed=opts.seed)
    print(f"wrote {len(shards)} samples in {len(shards.shards)} shard(s) to {opts.out} (index: {shards.index}); "
          f"{len(images.skipped)} file(s) skipped")
    return 0


def _cmd_report(opts: o.ReportOptions) -> int:
    from torchcls.report.html import build_report

    run_dir = Path(opts.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory: pass a run dir (runs/<name>) or a results folder")
    path, sections = build_report(run_dir)
    for _key, title, body in sections:
        print(f"{title:<22} {'included' if body is not None else 'not run'}")
    print(f"wrote {path}")
    return 0


def _cmd_models(opts: o.ModelsOptions) -> int:
    from torchcls.cli_output import print_models
    from torchcls.models.catalog import list_models

    return print_models(list_models(opts.pattern, opts.pretrained), opts.json)


# (command, options class, handler); a handler gets the options instance built from the parsed flags.
COMMANDS = [("evaluate", o.EvaluateOptions, _cmd_evaluate), ("predict", o.PredictOptions, _cmd_predict),
            ("explain", o.ExplainOptions, _cmd_explain), ("export", o.ExportOptions, _cmd_export),
            ("demo", o.DemoOptions, _cmd_demo), ("consolidate", o.ConsolidateOptions, _cmd_consolidate),
            ("report", o.ReportOptions, _cmd_report), ("models", o.ModelsOptions, _cmd_models)]
GROUPS = {"audit": ("audits: custom kernels (torchcls audit kernels)",
                    [("kernels", o.AuditKernelsOptions, _cmd_audit_kernels)]),
          "bench": ("benchmarks: torch.compile gains, memory when scaling (torchcls bench compile|memory)",
                    [("compile", o.BenchCompileOptions, _cmd_bench_compile),
                     ("memory", o.BenchMemoryOptions, _cmd_bench_memory)])}


def _add_commands(sub, commands) -> None:
    for name, cls, handler in commands:
        short, description = o.command_help(cls)
        p = sub.add_parser(name, help=short, description=description)
        o.add_flags(p, cls)
        p.set_defaults(func=lambda args, cls=cls, handler=handler: handler(o.from_args(cls, args)))


def build_parser() -> argparse.ArgumentParser:
    from torchcls.governance.commands import add_governance_commands
    from torchcls.serve.serve_config import ServeConfig

    parser = argparse.ArgumentParser(prog="torchcls", description="PyTorch-native image classification: "
                                     "train, evaluate and predict on real images.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("train", help="train a model; writes runs/<name>/", usage="torchcls train [--recipe NAME] "
                       "[--config FILE.toml] [--OPTION VALUE ...]", description="Train a model. Options "
                       f"come from --config FILE.toml (sections {' '.join(f'[{s}]' for s in SECTIONS)}) and flags.")
    add_config_flags(p)
    p.set_defaults(func=_cmd_train)
    _add_commands(sub, COMMANDS)
    p = sub.add_parser("serve", help="serve an artifact over HTTP (Open Inference Protocol v2 and /predict)",
                       description="An HTTP inference server with dynamic batching, a bounded queue and Prometheus "
                       "/metrics. Ctrl-C / SIGTERM answers the accepted requests, then exits. A .pt2 artifact is "
                       "native code: serve only artifacts you trust.")
    p.add_argument("artifact", help="a .pt2 / .onnx / .pte artifact from `torchcls export`, a .safetensors "
                   "checkpoint or a run dir")
    o.add_flags(p, ServeConfig, prefix="serve")
    p.set_defaults(func=_cmd_serve)
    _add_commands(add_governance_commands(sub), [("shard", o.ShardOptions, _cmd_shard)])  # data manifest|shard
    for group, (help_text, commands) in GROUPS.items():
        _add_commands(sub.add_parser(group, help=help_text).add_subparsers(
            dest=f"{group}_command", required=True, metavar=group.upper()), commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from torchcls.cli_errors import run  # unknown options, user errors, a closed pipe

    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())

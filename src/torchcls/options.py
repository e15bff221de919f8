"""Options of every command but `train` (whose options are the training config), declared once.

Each dataclass field carries its default, type, help and choices, and a number its range (`bound`); the CLI
generates its flags from them (`add_flags`, ranges checked in `from_args`) and the library functions take their
keyword defaults from the same fields (`ExportOptions.max_batch`, ...), so a default is never written in two
places. Light to import: `torchcls --help` must not pay for torch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from torchcls.config import (
    INT_RANGES,
    SECTIONS,
    Config,
    FloatRange,
    IntRange,
    is_recorded_config,
    keep_local,
    load_toml,
    opt,
    set_option,
)
from torchcls.errors import UserError

BAD_FILE_CHOICES = ("error", "skip")
# Ranges shared by several commands (as INT_RANGES / FLOAT_RANGES declare them: (min, max, why), (interval, why)).
BATCH = IntRange(1, 65536, "images per forward pass: 2^16 images of 224 px are 37 GiB")
WORKERS = INT_RANGES[("data", "workers")]
THREADS = INT_RANGES[("train", "threads")]
IMG_SIZE = INT_RANGES[("data", "img_size")]
FRACTION = FloatRange("[0, 1]", "a fraction")
JOB_TIMEOUT = IntRange(1, 7 * 86400, "seconds: a week")


def positional(help: str, nargs: str | None = None) -> Any:
    """A required positional argument (no default)."""
    return field(default=None, metadata={"help": help, "positional": True, "nargs": nargs})


def required(help: str) -> Any:
    """A required --flag."""
    return field(default=None, metadata={"help": help, "required": True})


@dataclass
class RuntimeOptions:
    device: str = opt("auto", "auto, cpu, cuda, cuda:N (auto: an exported .pt2 runs where it was built; "
                      "otherwise cuda when a GPU is visible)")
    on_bad_file: str = opt("error", "unreadable images: stop with an error, or skip them and list them",
                           choices=BAD_FILE_CHOICES)


@dataclass
class EvaluateOptions(RuntimeOptions):
    """evaluate a checkpoint; writes eval.json and a confusion matrix

    Evaluate a checkpoint on its held-out data (or other data)."""
    checkpoint: str = positional("a .safetensors checkpoint or a run dir (uses its best checkpoint)")
    data: str | None = opt(None, "evaluate on other data (built-in name, ImageFolder dir or CSV) instead of the "
                           "training data's held-out split")
    root: str | None = opt(None, "fashion-mnist directory, or base for relative CSV paths")
    split: str | None = opt(None, "which part of the data (default: test where the data has a test split, else "
                            "val)", choices=("val", "test", "train", "all"))
    out: str | None = opt(None, "write eval.json here (default: the checkpoint's run dir)")
    json: bool = opt(False, "print the full result as JSON")
    threshold: float | None = opt(None, "early-exit models: exit confidence threshold in [0, 1] (default: the one "
                                  "it was trained with)", bound=FloatRange("[0, 1]", "a softmax probability"))
    target_accuracy: float | None = opt(None, "early-exit models: calibrate the threshold on the validation "
                                        "split: the cheapest one reaching this accuracy (e.g. 0.9)", bound=FRACTION)
    target_compute: float | None = opt(None, "early-exit models: calibrate the threshold on the validation split: "
                                       "the most accurate one whose mean FLOPs stay within this fraction of the "
                                       "backbone's (e.g. 0.7)",
                                       bound=FloatRange("(0, 1.5]", "a fraction of the backbone's compute; exits "
                                                                    "add some"))
    batch_size: int = opt(256, "images per forward pass", bound=BATCH)
    workers: int = opt(2, "DataLoader workers", bound=WORKERS)
    tta: str = opt("none", "test-time augmentation: flip = average the softmax of each image and its horizontal "
                   "mirror (two forward passes; for left-right symmetric classes); multicrop = also both translated "
                   "1 px down-right and up-left (six passes, airbench's weights: 1/4 each untranslated view, 1/8 "
                   "each translated); recorded in eval.json", choices=("none", "flip", "multicrop"))


TOPK = IntRange(1, 1_000_000, "labels per image; more than the model's classes lists them all")
# Integrated gradients runs --steps forwards and backwards of the model per image, EXPLAIN_BATCH of them at once
# (captum's internal_batch_size, so memory does not grow with --steps); past the max an image takes hours.
EXPLAIN_STEPS = IntRange(1, 10_000, "forward and backward passes per image; captum's examples use 50")


@dataclass
class PredictOptions(RuntimeOptions):
    """classify image files or folders

    Top-k labels for images, from a checkpoint, a run dir or an exported artifact."""
    checkpoint: str = positional("a .safetensors checkpoint, a run dir, or an exported .pt2/.onnx/.pte artifact "
                                 "(a .pt2 is native code: load only artifacts you trust)")
    images: list[str] = positional("image files and/or folders (searched recursively)", nargs="+")
    topk: int = opt(3, "how many labels per image", bound=TOPK)
    tta: str = opt("none", "test-time augmentation: flip = average the softmax of each image and its horizontal "
                   "mirror (two forward passes, also for exported artifacts); multicrop = also both translated 1 px "
                   "down-right and up-left (six passes)", choices=("none", "flip", "multicrop"))
    json: bool = opt(False, "print JSON instead of a table")
    precision: str = opt("auto", "a checkpoint runs in: auto = bf16 where the hardware computes it natively (CPU "
                         "with AVX-512-bf16 or AMX, GPU of compute capability >= 8.0), else fp32; an exported "
                         "artifact keeps the precision it was exported in", choices=("auto", "fp32", "bf16"))
    expect_sha256: str | None = opt(None, "refuse to load the model unless its file has this SHA-256 (default: "
                                    "the digest governance registered for an exported artifact, if any)")
    trust_artifact: bool = opt(False, "load a .pt2 that nothing vouches for (not exported on this machine, no "
                               "--expect-sha256, no registration under your audit key): it is native code, run as "
                               "soon as it is loaded; only for a file you trust")


@dataclass
class ExplainOptions:
    """attribution maps: which pixels drove a prediction (PNG overlays)

    Attribution maps with captum for a checkpoint (plain or early-exit model)."""
    checkpoint: str = positional("a .safetensors checkpoint or a run dir")
    images: list[str] = positional("image files and/or folders (searched recursively)", nargs="+")
    method: str = opt("integrated-gradients", "attribution method", choices=("integrated-gradients", "saliency"))
    target: str | None = opt(None, "class to explain (default: the predicted one)")
    steps: int = opt(32, "integrated-gradients steps", bound=EXPLAIN_STEPS)
    out: str | None = opt(None, "folder for the PNGs (default: <run dir>/explain)")
    on_bad_file: str = opt("error", "unreadable images: stop with an error, or skip them", choices=BAD_FILE_CHOICES)


@dataclass
class ExportOptions:
    """export a checkpoint to an AOTInductor package, ONNX or ExecuTorch, verified against eager

    Export a checkpoint (torch.export with a dynamic batch dimension; the torch.cond form of early-exit
    models) to an AOTInductor .pt2 package, an ONNX model or an ExecuTorch .pte program that carries its
    class names and preprocessing, check it against eager on held-out images (parity.json beside it) and
    refuse to write it when top-1 agreement is below --min-agreement."""
    checkpoint: str = positional("a .safetensors checkpoint or a run dir")
    target: str = opt("auto", "auto: every target this machine runs (aoti; onnx on ONNX Runtime and on OpenVINO, when "
                      "installed) is exported and checked, and the fastest here is the result (parity.json's choice "
                      "says why; a CUDA export builds aoti); aoti: .pt2 AOTInductor package (runs from Python with "
                      "torch only, or C++); onnx: an ONNX model (--runtime); executorch: .pte program for the "
                      "ExecuTorch runtime on devices", choices=("auto", "aoti", "onnx", "executorch"))
    runtime: str | None = opt(None, "--target onnx: the runtime it is checked on and runs on: onnxruntime (default) or "
                              "openvino (CPU; bf16 where the CPU computes it natively)",
                              choices=("onnxruntime", "openvino"))
    precision: str = opt("auto", "weights and compute inside the artifact; inputs and logits stay float32. auto = "
                         "bf16 where the hardware computes it natively (CPU with AVX-512-bf16 or AMX, GPU of compute "
                         "capability >= 8.0) and the target builds it (aoti), else fp32; --target auto also tries "
                         "int8 on the CPU; parity.json says which and why. int8: static int8 .pt2 for the CPU "
                         "(aoti), calibrated on training images (7-bit activations where its int8 kernels lack "
                         "VNNI)", choices=("auto", "fp32", "bf16", "int8"))
    max_batch: int = opt(64, "largest batch the artifact accepts",
                         bound=IntRange(1, 4096, "artifacts/targets/base.MAX_BATCH"))
    out: str | None = opt(None, "artifact path (.pt2/.onnx/.pte) or folder (default: "
                          "<run dir>/export/<target>-<precision>/model.<ext>); parity.json goes beside it")
    min_agreement: float | None = opt(None, "least top-1 agreement with eager for the export to succeed "
                                      "(default: 0.999 for fp32, 0.99 for bf16 and aoti int8, 0.95 for "
                                      "executorch int8)", bound=FRACTION)
    parity_images: int = opt(500, "held-out images for parity",
                             bound=IntRange(1, 1_000_000, "images decoded and run twice"))
    data: str | None = opt(None, "take parity images from this data (same classes) instead of the checkpoint's "
                           "held-out split")
    root: str | None = opt(None, "fashion-mnist directory, or base for relative CSV paths")
    quantize: str | None = opt(None, "executorch: int8 weights and activations (PT2E, XNNPACK quantizer, "
                               "per-channel), calibrated on training images (default: none)",
                               choices=("none", "int8"))
    backend: str | None = opt(None, "executorch: delegate to XNNPACK, or portable kernels only (default: xnnpack)",
                              choices=("xnnpack", "portable"))
    calibration_images: int | None = opt(None, "int8 (executorch --quantize int8, aoti --precision int8): training "
                                         "images used to calibrate activation ranges (default: up to 256, at "
                                         "least 16)",
                                         bound=IntRange(1, 1_000_000, "images decoded and run to calibrate"))
    device: str = opt("cpu", "where the artifact will run: cpu, cuda, cuda:N, or auto (cuda when a GPU is visible). "
                      "The model is captured, compiled and checked there; a CUDA .pt2 runs only on GPUs of the "
                      "build GPU's compute capability (recorded in its metadata)")
    autotune: bool = opt(False, "aoti: Inductor max-autotune (benchmarks GEMM/convolution kernels while compiling: "
                         "minutes longer, faster kernels on a GPU)")


@dataclass
class DemoOptions:
    """train the built-in net on mnist-5k, evaluate and report

    The end-to-end demo: a real model on real digits in a few minutes on a CPU."""
    out_dir: str = opt("runs", "parent of the run dir")
    name: str = opt("demo", "run name (an old demo run is replaced)")
    epochs: int | None = opt(None, "override the demo's epoch count (default: 8)",
                             bound=INT_RANGES[("train", "epochs")])
    threads: int = opt(0, "intra-op CPU threads (0 = OMP_NUM_THREADS if set, else the CPUs this process may use: "
                       "affinity and cgroup quota); on a machine shared with other work, 1 may be much faster",
                       bound=THREADS)


@dataclass
class ConsolidateOptions:
    """merge a sharded (DCP) checkpoint into one safetensors file

    Load a torch.distributed.checkpoint written by any number of ranks into one process and write a
    single safetensors file (for evaluate, predict, export)."""
    checkpoint: str = positional("a run dir (uses checkpoints/last.dcp) or a DCP checkpoint dir")
    out: str | None = opt(None, "output .safetensors (default: checkpoints/consolidated.safetensors)")
    unsafe_unpickle: bool = opt(False, "read a checkpoint in torch's older pickle format (.metadata, written before "
                                "torchcls saved sharded checkpoints pickle-free), through a restricted unpickler. "
                                "Only for checkpoints you trust")


@dataclass
class AuditKernelsOptions:
    """custom ops, fake impls, opcheck, GPU archs of extensions, Triton kernels

    Audit custom operators (dispatch keys, fake impl, autograd, opcheck), the GPU architectures compiled
    extensions target, Triton kernels, and the custom ops a model's exported graph calls. Exit code 1
    when a check fails (for CI)."""
    imports: list[str] | None = opt(None, "import this package first (it registers the ops); repeatable",
                                    flag="import")
    model: str | None = opt(None, "a checkpoint or run dir, a model name, or package.module:factory returning a "
                            "module (or (module, example_input)); its exported graph is searched for custom ops")
    namespaces: list[str] | None = opt(None, "audit only this op namespace (default: those the imports register, "
                                       "else all non-PyTorch); repeatable", flag="namespace")
    out: str | None = opt(None, "write kernel_audit.json/.md here (default: the run dir of --model, else "
                          "./kernel-audit)")
    json: bool = opt(False, "print JSON instead of the table")


@dataclass
class BenchCompileOptions:
    """eager vs torch.compile per backbone, batch, precision and mode

    Latency/throughput of eager vs compiled inference, cold compile time, graph breaks with reasons,
    recompiles over batch sizes, parity and peak memory; each configuration in its own process. Writes
    bench_compile.json/.md/.png."""
    models: str = required("comma-separated model names (timm, tv/..., smallnet), checkpoints, or "
                           "package.module:factory")
    batch: str = opt("1,16", "comma-separated batch sizes")
    precision: str = opt("fp32", "comma-separated: fp32, bf16 (autocast)")
    modes: str = opt("default", "comma-separated torch.compile modes")
    device: str = opt("cpu", "cpu or cuda")
    img_size: int | None = opt(None, "input size (default: 224; 28 for smallnet)", bound=IMG_SIZE)
    repeats: int = opt(10, "interleaved timed calls per side", bound=IntRange(1, 1_000_000, "timed calls"))
    timeout: int = opt(1800, "seconds per configuration before it is recorded as failed", bound=JOB_TIMEOUT)
    out: str = opt("bench-compile", "output folder; a run dir puts the results in its report")


@dataclass
class BenchMemoryOptions:
    """per-rank memory of DDP/FSDP2 training over world sizes, and what fits

    Real torchrun jobs per (parallel, world size): per-rank parameter, gradient, optimizer, activation and
    peak memory next to the analytic model; for the cluster given by --device-memory, which ranks limit
    the batch and what per-rank batch or sharding fits. Writes bench_memory.json/.md/.png."""
    model: str = required("model name (timm, tv/..., smallnet), random init")
    parallel: str = opt("ddp,fsdp2", "comma-separated: ddp, fsdp2")
    world_sizes: str = opt("1,2", "comma-separated ranks per job")
    device_memory: str | None = opt(None, "memory per rank, in rank order, e.g. 80GiB,40GiB (a shorter list "
                                    "repeats: 80GiB,40GiB at 4 ranks is 80,40,80,40); more entries than the largest "
                                    "world size adds a projection to that many ranks (default: this machine's GPU, "
                                    "or its RAM / ranks)")
    batch: int = opt(2, "images per rank in the measured steps", bound=BATCH)
    img_size: int | None = opt(None, "input size (default: 224; 28 for smallnet)", bound=IMG_SIZE)
    steps: int = opt(2, "training steps per job", bound=IntRange(1, 1_000_000, "measured training steps"))
    overhead: str = opt("1GiB", "allowance per rank for the runtime, CUDA context and workspaces in the fit")
    timeout: int = opt(1800, "seconds per job before it is recorded as failed", bound=JOB_TIMEOUT)
    out: str = opt("bench-memory", "output folder; a run dir puts the results in its report")


@dataclass
class ShardOptions:
    """write a data set as WebDataset tar shards with an index

    Write a data set (folder, CSV, built-in set or hf:PATH) as WebDataset tar shards (the format timm,
    OpenCLIP and DataComp read: each sample's original file bytes plus its class) and index.json with
    each shard's sample count, size and SHA-256; `torchcls train --data DIR` then streams them."""
    source: str = positional("the data to shard: built-in name, ImageFolder directory, CSV or hf:PATH")
    out: str = required("output folder (must not exist or be empty); it appears only once complete")
    shard_size: str = opt("1GB", "largest shard size (e.g. 500MB, 1GiB)")
    split: str = opt("train", "which split of the source to write (a val/ folder or a CSV split column is "
                     "written with --split val)", choices=("train", "val", "test", "all"))
    root: str | None = opt(None, "fashion-mnist directory, or base for relative CSV paths")
    channels: int | None = opt(None, "load images with 1 or 3 channels (default: as the source has them)",
                               bound=INT_RANGES[("data", "channels")])
    seed: int = opt(0, "seed of the sample order inside the shards", bound=INT_RANGES[("train", "seed")])
    on_bad_file: str = opt("error", "unreadable images: stop with an error, or leave them out and list them",
                           choices=BAD_FILE_CHOICES)


@dataclass
class ModelsOptions:
    """list model names and pretrained tags (timm, torchvision, built-in)

    The names --model takes: torchcls's own (smallnet, fastnet, fastnet_slim, fastnet_lite), early-exit forms
    (ee/...), timm's registry and torchvision's classifiers (tv/...). With --pretrained: timm's names with a pretrained
    tag, the hub repository of each (--pretrained hf-hub:ORG/NAME, or --model NAME.TAG --pretrained)
    and whether its weights are in the local Hugging Face cache (usable offline)."""
    pattern: str | None = positional("part of a name (convnext), or an fnmatch pattern (resnet1*)", nargs="?")
    pretrained: bool = opt(False, "list timm's pretrained tags instead, with their hub repository")
    json: bool = opt(False, "print JSON")


@dataclass
class ReportOptions:
    """(re)write RUN_DIR/report.html from every result found in the run dir

    One HTML page with the run's training, evaluation, exports/parity, compile gains, memory and
    kernel-audit results (each section says 'not run' when absent)."""
    run_dir: str = positional("a run dir (runs/<name>) or any folder of results")


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def split_ints(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in split_list(text)]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None


def concrete_type(cls: type, f: dataclasses.Field) -> Any:
    """A field's type with `X | None` reduced to X."""
    t = typing.get_type_hints(cls)[f.name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def command_help(cls: type) -> tuple[str, str]:
    """(one-line help, description) of a command, from its options class's docstring."""
    first, _, rest = (cls.__doc__ or "").partition("\n\n")
    return first.strip(), " ".join(rest.split()) or first.strip()


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "", suppress_defaults: bool = False) -> None:
    """One argument per field of `cls`; with `prefix`, values land in args as '<prefix>.<name>'.

    `suppress_defaults`: flags not given stay out of args (so they do not override a TOML file)."""
    for f in dataclasses.fields(cls):
        t, meta = concrete_type(cls, f), f.metadata
        dest = f"{prefix}.{f.name}" if prefix else f.name
        if meta.get("positional"):
            parser.add_argument(dest, nargs=meta.get("nargs"), help=meta["help"])
            continue
        flag = "--" + (meta.get("flag") or f.name).replace("_", "-")
        shown = "" if f.default in (None, False) or meta.get("required") else f" (default: {f.default})"
        default = argparse.SUPPRESS if suppress_defaults else f.default
        kwargs: dict[str, Any] = dict(dest=dest, default=default, help=meta["help"] + shown)
        if t is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(t) is list:
            parser.add_argument(flag, action="append", metavar=f.name.upper().rstrip("S"), **kwargs)
        else:
            if meta.get("const") is not None:  # the flag alone means `const` (`--pretrained` = 'hub')
                kwargs.update(nargs="?", const=meta["const"])
            parser.add_argument(flag, type=t, choices=meta.get("choices"), required=bool(meta.get("required")),
                                metavar=None if meta.get("choices") else f.name.upper(), **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The options instance of `cls` that the parsed `args` describe, its numbers checked against their ranges."""
    options = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    check_options(options, "command line")
    return options


def check_options(options: Any, origin: str) -> None:
    """Every number option of a command's options instance (or ServeConfig) within its declared `bound`."""
    check_values(type(options), origin, **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})


def check_values(cls: type, origin: str, **values: Any) -> None:
    """`values` (option name = value, as a library function takes them) within the bounds `cls` declares for
    them: a UserError naming the flag, the value and the range, as config.check_range does for `train`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in values.items():
        f = fields[name]
        bound = f.metadata.get("bound")
        if bound is None or value is None:  # (None: an optional option left unset)
            continue
        flag = "--" + (f.metadata.get("flag") or name).replace("_", "-")
        if isinstance(bound, FloatRange) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise UserError(f"{origin}: {flag} must be a number in {bound.interval}, got {value!r}")  # (from Python)
        if isinstance(bound, IntRange) and type(value) is not int:  # (from Python: 2.5, True or "3")
            raise UserError(f"{origin}: {flag} must be an integer from {bound.lo:,} to {bound.hi:,}, got {value!r}")
        problem = bound.problem(value)
        if problem is not None:
            raise UserError(f"{origin}: {flag} = {problem}")


def kwargs_of(options: Any, *skip: str) -> dict[str, Any]:
    """The fields of an options instance as keyword arguments for its library function."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in skip}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """`torchcls train`'s flags: one per field of every config section."""
    parser.add_argument("--recipe", metavar="NAME", help="start from a named recipe (`--recipe list` shows them); "
                        "--config and flags override it")
    parser.add_argument("--config", metavar="FILE.toml", help="load options from a TOML file; flags override it")
    for section, cls in SECTIONS.items():
        add_flags(parser.add_argument_group(f"[{section}] options"), cls, prefix=section, suppress_defaults=True)


def config_from_args(args: argparse.Namespace) -> Config:
    """The recipe of --recipe (or the defaults), overridden by the TOML file of --config, then by the flags given."""
    from torchcls.recipes import load_recipe

    base = load_recipe(args.recipe) if getattr(args, "recipe", None) else Config()
    local = copy.deepcopy(base)  # what a recorded config may not change (load_toml fills `base` in place)
    cfg = load_toml(args.config, base) if args.config else base
    given = set()
    for dest, value in vars(args).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            set_option(cfg, section, key, value, origin="command line")
            given.add((section, key))
    # With --resume any config is taken as the record of the run it continues, whatever its name and neighbours
    # (a shared one with no run dir's files beside it, or renamed settings.toml, could send the run elsewhere):
    # what bounds input, sends data out or names the audit files comes from the command line
    recorded = bool(args.config) and is_recorded_config(args.config, cfg)
    if recorded or (args.config and cfg.run.resume):
        _note_ignored(args.config, keep_local(cfg, local, frozenset(given)))
    if recorded:  # a run dir's own config.toml: the run dir it is in is the one continued
        _run_dir_it_is_in(args.config, cfg, given)
    return cfg


def _run_dir_it_is_in(path: str, cfg: Config, given: set[tuple[str, str]]) -> None:
    """A run dir's config.toml continues the run dir it lies in, not the one it names: a received one could name
    the user's own runs/prod (whose checkpoints --resume would continue and whose audit log, beside it, would
    take the record). --out-dir / --name on the command line still choose."""
    import os
    from pathlib import Path

    here = Path(os.path.abspath(path)).parent
    named = (cfg.run.out_dir, cfg.run.name)
    cfg.run.out_dir = cfg.run.out_dir if ("run", "out_dir") in given else str(here.parent)
    cfg.run.name = cfg.run.name if ("run", "name") in given else here.name
    if Path(os.path.abspath(named[0])) / str(named[1]) != here and not {("run", "out_dir"), ("run", "name")} & given:
        from torchcls.console import console

        console.print(f"[yellow]note: {path} names the run dir {Path(named[0]) / str(named[1])}; continuing the one "
                      f"it is in, {here}[/]", highlight=False, soft_wrap=True)


def _note_ignored(path: str, ignored: list[tuple[str, str, Any]]) -> None:
    """One line naming the recorded values a run dir's config.toml may not set, and the flags that do."""
    if not ignored:
        return
    from torchcls.console import console

    values = ", ".join(f"{key} = {value!r}" for _, key, value in ignored)
    flags = " ".join(f"--{key.replace('_', '-')}" for _, key, _ in ignored)
    console.print(f"[yellow]note: {path} is taken as a run's recorded config (a run dir's, or given to --resume): "
                  f"its {values} not taken (what bounds input "
                  f"costs, sends data elsewhere or names the audit log and its keys comes from the command line: "
                  f"give {flags} to keep them)[/]",
                  highlight=False, soft_wrap=True)

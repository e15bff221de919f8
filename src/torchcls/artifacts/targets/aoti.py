"""AOTInductor target: a `.pt2` package of compiled code and frozen weights (needs torch, not the
model code). Metadata: the package's `aot_inductor.metadata`, key `torchcls` = the ArtifactInfo JSON,
plus flat `torchcls.*` keys that the C++ runner (cpp/) reads.

A CPU package with a batch bound above 1 holds two compiled models: `model`, whose batch dimension is dynamic
(what the C++ runner loads), and `batch1`, the same program with its batch fixed at 1, which the Python loader
runs for single images. Inductor's code for a dynamic batch is slow at batch 1 (ResNet-50 at 224 px: 57.6 ms
against 43.0 ms static; a 28 px ResNet-18: 6.8 ms against 1.0 ms), the batch serving sees most. The package then
carries the weights twice (each model's frozen constants are compiled into its own library).

An int8 package (bound 16 or more) holds a third, `batch16`, and runs batches of 16 or more through it in chunks of
16 (the rest of a batch as any smaller one): oneDNN's int8 convolutions are slow with a dynamic batch (a trained
ResNet-50 at 224 px: 58.8 images/s at batch 16 against 87.2 static; its bf16 package 49.3 against 52.5, not worth
a third copy of the weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from torchcls.artifacts.placement import compiled_device
from torchcls.artifacts.targets.base import (
    META_KEY,
    ArtifactInfo,
    ExportRequest,
    LoadedArtifact,
    Plan,
    Target,
    checked_info,
    first_line,
    has_cond,
)
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.noise import INT8_LOWERING, warnings_without

BATCH1_MODEL = "batch1"  # the package's static batch-1 model
BATCH1_KEY = "torchcls.batch1_model"  # metadata: its name, where the package has one
BATCH16_MODEL = "batch16"  # an int8 package's static batch-16 model
BATCH16_KEY = "torchcls.batch16_model"
STATIC_CHUNK = 16


class AOTIArtifact(LoadedArtifact):
    """A .pt2 package, loaded on the device it was built for (see torchcls.artifacts.placement)."""

    def __init__(self, path: str | Path, device: str = "auto"):
        path = Path(path)
        meta = package_metadata(path)  # before the shared library is loaded: a foreign build is refused first
        if META_KEY not in meta:
            raise UserError(f"{path} is an AOTInductor package without torchcls metadata (class names, "
                            "preprocessing); export it with `torchcls export --target aoti`")
        self.info = checked_info(meta[META_KEY], path, "aoti")
        # AOTInductor's own key says what the compiled code is; ours adds the capability and GPU name.
        built = meta.get("AOTI_DEVICE_KEY") or self.info.device
        self.device = compiled_device(built, self.info.compute_capability, self.info.gpu, path, device)
        index = self.device.index if self.device.type == "cuda" else -1
        try:
            self.runner = load_runner(path, index)
            # Packages from before the batch-1 model, and CUDA ones, have none: they run batch 1 on `model`.
            self.batch1 = load_runner(path, index, BATCH1_MODEL) if meta.get(BATCH1_KEY) == BATCH1_MODEL else None
            self.batch16 = load_runner(path, index, BATCH16_MODEL) if meta.get(BATCH16_KEY) == BATCH16_MODEL else None
        except Exception as e:  # the loader raises RuntimeError or zipfile errors on foreign or broken files
            raise UserError(f"{path} is not a loadable AOTInductor package ({first_line(e)}); export one with "
                            "`torchcls export CHECKPOINT --target aoti`") from None

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        if self.batch16 is not None and n >= STATIC_CHUNK:
            whole = n - n % STATIC_CHUNK
            parts = [self.batch16(chunk) for chunk in x[:whole].split(STATIC_CHUNK)]
            if whole < n:
                parts.append(self._run(x[whole:]))
            return parts[0] if len(parts) == 1 else tuple(torch.cat(outputs) for outputs in zip(*parts))
        runner = self.batch1 if self.batch1 is not None and n == 1 else self.runner
        return runner(x)


def load_runner(path: Path, device_index: int, model: str = "model") -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """One model of the package, as a function from the input batch to its outputs, flat (logits, or logits
    and exits). AOTInductor's package loader is called once: torch's aoti_load_package (2.11 to 2.14 at least)
    treats any RuntimeError of the loader as an outdated package and loads the same package again through its
    legacy path: for a CUDA package that second load runs after a half-initialised first one in the same process
    (loading one package twice is a known segfault, pytorch#123280), and the error reported is the second's
    (pytorch#186943 made CUDA loads fail fast for this reason). Our packages keep their weights inside the
    shared library (aoti_compile_and_package's default), which is all the modern path adds for them. The model
    is run without the AOTICompiledModel wrapper that aoti_load_package returns: that one parses the call's
    input and output structure from JSON on every call, a cost a batch-1 call notices, and ours is fixed
    (one tensor in, a flat tuple out)."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), model, False, 1, device_index)
    return lambda x: tuple(loader.boxed_run([x]))  # boxed: the loader takes the list and frees x's slot early


def package_metadata(path: Path) -> dict[str, str]:
    """The package's metadata (ours and AOTInductor's: AOTI_DEVICE_KEY, AOTI_COMPUTE_CAPABILITY...), read from
    the archive without loading its compiled code."""
    try:
        return dict(torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(str(path), "model"))
    except Exception as e:  # RuntimeError for a file that is not a .pt2 archive
        raise UserError(f"{path} is not a loadable AOTInductor package ({first_line(e)}); export one with "
                        "`torchcls export CHECKPOINT --target aoti`") from None


@contextlib.contextmanager
def cond_safe_inductor(ep: torch.export.ExportedProgram) -> Iterator[None]:
    """Inductor's layout optimization turns convolutions channels-last; inside torch.cond branches that
    gave stride assertions or silently wrong outputs on one branch, so it is off for cond programs."""
    import torch._inductor.config as inductor_config

    old = inductor_config.layout_optimization
    inductor_config.layout_optimization = old and not has_cond(ep)
    try:
        yield
    finally:
        inductor_config.layout_optimization = old


def build(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path, extra: dict[str, str],
          autotune: bool = False, freezing: bool = True, batch16: bool = False) -> dict[str, Any]:
    """AOTInductor package with frozen weights (constants folded, conv weights prepacked), compiled for the
    device the program was captured on (CPU: C++/OpenMP; CUDA: Triton kernels and cubins for this GPU's
    compute capability). `autotune`: Inductor's max-autotune (benchmarks GEMM/conv kernel choices).
    `freezing=False` only for diagnosis (benchmarks/gpu/aoti_diag.py): every export freezes. `batch16`: a
    static batch-16 model too (int8; the module's docstring says why)."""
    metadata = {META_KEY: info.to_json(**extra), **info.flat_metadata()}
    static = {}
    if info.device == "cpu" and info.max_batch >= 2:
        static[BATCH1_MODEL], metadata[BATCH1_KEY] = 1, BATCH1_MODEL
    if info.device == "cpu" and batch16 and info.max_batch >= STATIC_CHUNK:
        static[BATCH16_MODEL], metadata[BATCH16_KEY] = STATIC_CHUNK, BATCH16_MODEL
    configs: dict[str, Any] = {"freezing": freezing, "aot_inductor.metadata": metadata}
    if autotune:
        configs["max_autotune"] = True
    report: dict[str, Any] = {"autotune": autotune} if autotune else {}
    with cond_safe_inductor(ep), torch.no_grad(), warnings_without(INT8_LOWERING):  # torchcls.noise
        if static:
            report |= {"models": ["model", *static]} | _package_with_static(ep, path, configs, static)
        else:
            if info.device == "cpu" and info.max_batch == 1:  # the one model is a batch-1 model
                ep, sums = _static_program(ep, 1)
                report |= {"batch1_point_convs_as_sums": sums} if sums else {}
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)
    return report


def _package_with_static(ep: torch.export.ExportedProgram, path: Path, configs: dict[str, Any],
                         static: dict[str, int]) -> dict[str, int]:
    """`ep` as `model` and, captured again from it with the batch fixed, as each of `static` (name: batch), in
    one package: how aoti_compile_and_package's documentation packages several models (aot_compile with
    aot_inductor.package, then package_aoti), and what aoti_compile_and_package does for one. Returns how many
    point convolutions the batch-1 model runs as sums (`_static_program`), where it has any."""
    from torch._inductor.package import package_aoti

    programs, sums = {"model": ep}, 0
    for name, batch in static.items():
        programs[name], rewritten = _static_program(ep, batch)
        sums += rewritten
    files = {}
    for name, program in programs.items():
        args, kwargs = program.example_inputs
        files[name] = torch._inductor.aot_compile(program.module(check_guards=False), args, kwargs,
                                                  options=configs | {"aot_inductor.package": True})
    package_aoti(str(path), files)
    return {"batch1_point_convs_as_sums": sums} if sums else {}


def _static_program(ep: torch.export.ExportedProgram, batch: int) -> tuple[torch.export.ExportedProgram, int]:
    """`ep` captured again with its batch fixed at `batch`. At batch 1 its point convolutions over a 1x1 map
    become sums (artifacts/point_convs.py): the program, and how many were rewritten (`ep` itself if it is
    static at batch 1 and has none)."""
    from torchcls.artifacts.point_convs import point_convs_as_reductions

    module = ep.module(check_guards=False)
    rewritten = point_convs_as_reductions(module) if batch == 1 else 0
    args, kwargs = ep.example_inputs
    if args[0].shape[0] == batch and not rewritten:
        return ep, 0
    one = args[0][:1]
    return torch.export.export(module, (one.expand(batch, *one.shape[1:]).contiguous(),), kwargs), rewritten


def check(req: ExportRequest) -> None:
    if req.early_exit and req.precision != "fp32":
        raise UserError(f"--precision {req.precision}: early-exit models export in fp32 only")
    if req.precision == "int8" and req.device != "cpu":
        raise UserError("--precision int8: the int8 .pt2 runs oneDNN's CPU kernels; export it with --device cpu "
                        "(on a GPU, --precision bf16)")


def plan(req: ExportRequest, meta: Any) -> Plan:
    if req.precision == "int8":
        return _int8_plan(req, meta)
    if req.autotune:
        return Plan(req.precision, lambda ep, info, path, extra: build(ep, info, path, extra, autotune=True))
    return Plan(req.precision, build)


def _int8_plan(req: ExportRequest, meta: Any) -> Plan:
    """Static int8, calibrated on the checkpoint's training images (or --data's)."""
    import importlib.util

    from torchcls.artifacts.quantize import AOTI_INT8_MIN_AGREEMENT, calibration_images
    from torchcls.extras import missing_extra

    if importlib.util.find_spec("torchao") is None:
        raise missing_extra("precision", "--precision int8 (PT2E quantization)", "torchao")
    calib = calibration_images(meta, req.calibration_images, req.data, req.root)
    return Plan("int8", int8_builder(calib), AOTI_INT8_MIN_AGREEMENT)


def int8_builder(calibration: torch.Tensor):
    """A builder of static int8 packages (artifacts/quantize.py: PT2E, X86InductorQuantizer) observed on
    `calibration`: the program is captured in fp32 and quantized here, then compiled frozen as every .pt2 is
    (freezing is what fuses the quantized convolutions into oneDNN's int8 kernels). On a CPU whose int8 kernels
    lack VNNI the activations are quantized to 7 bits (quantize.int8_reduce_range), recorded as `reduce_range`."""
    from torchcls.artifacts.quantize import int8_reduce_range, quantize_int8_x86

    def build_int8(ep: torch.export.ExportedProgram, info: ArtifactInfo, path: Path,
                   extra: dict[str, str]) -> dict[str, Any]:
        dynamic = ({0: torch.export.Dim("batch", min=1, max=info.max_batch)},) if info.max_batch >= 2 else None
        reduce_range = int8_reduce_range()
        if reduce_range:
            console.print("int8: oneDNN's int8 kernels here lack VNNI (they add products in 16 bits); activations "
                          "are quantized to 7 bits (0-127), which they add exactly")
        quantized = quantize_int8_x86(ep, calibration, dynamic, batch=min(32, info.max_batch),
                                      reduce_range=reduce_range)
        return build(quantized, info, path, extra, batch16=True) | {"calibration_images": len(calibration),
                                                      "quantizer": "x86_inductor", "reduce_range": reduce_range}

    return build_int8


TARGET = Target("aoti", ".pt2", AOTIArtifact, check, plan)

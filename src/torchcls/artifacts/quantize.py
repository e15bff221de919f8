"""Quantization with its parity check, for the deployment paths.

- Int8 through the PT2E flow: the exported graph is annotated by a backend's quantizer, observed on real
  training images of the checkpoint's own data, converted, and exported again (same dynamic batch
  dimension). ExecuTorch/XNNPACK: XNNPACK's quantizer (symmetric, per-channel weights, int8 activations).
  AOTInductor on x86: torchao's X86InductorQuantizer (per-channel int8 weights, uint8 activations), whose
  quantize/dequantize pairs Inductor's freezing passes fuse into oneDNN's int8 convolutions and matmuls.
  Calibration uses real images on purpose: activation ranges from random or synthetic inputs are
  wrong for a trained network (and random-init BatchNorm statistics are degenerate).
- `quantize_for_inference`: an eager model converted by torchcls.precision.inference (bf16, int8,
  fp8) and checked against the fp32 model with parity.compare, on held-out images
  (`heldout_batches`), within a bound per precision.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from torchcls.artifacts.parity import compare, held_out_images
from torchcls.checkpoint.files import CheckpointMeta, read_meta, resolve_checkpoint
from torchcls.config import Config
from torchcls.data import eval_dataset
from torchcls.errors import UserError
from torchcls.noise import INT8_QUANTIZER, warnings_without
from torchcls.precision.inference import apply_inference_precision

QUANTIZE = ("none", "int8")
# An int8 .pt2 stands in for the fp32 model on a server (auto may choose it): held to bf16's bound, not to
# the edge program's 0.95 (a phone's size and power budget buy more tolerance than a server's speed does)
AOTI_INT8_MIN_AGREEMENT = 0.99
MIN_CALIBRATION = 16  # fewer images give activation ranges that one outlier image decides
DEFAULT_CALIBRATION = 256
INT8_MIN_AGREEMENT = 0.95
# Default bounds of quantize_for_inference: (max |Δlogit| relative to the fp32 model's max |logit|,
# min top-1 agreement).
PARITY_BOUNDS = {"fp32": (1e-5, 1.0), "bf16": (0.05, 0.95), "int8": (0.05, 0.95), "fp8": (0.1, 0.95)}


def calibration_images(meta: CheckpointMeta, n: int | None, data: str | None = None,
                       root: str | None = None) -> torch.Tensor:
    """`n` images spread over the training split of the checkpoint's data, preprocessed as at
    evaluation (no augmentation: the program sees evaluation-style inputs). `n=None`: up to
    DEFAULT_CALIBRATION, as many as the split has."""
    if n is not None and n < MIN_CALIBRATION:
        raise UserError(f"--calibration-images {n}: int8 calibration needs at least {MIN_CALIBRATION} images")
    cfg = Config.recorded(meta.config, origin="checkpoint metadata")
    data_cfg = cfg.data if data is None else replace(cfg.data, source=data, root=root)
    if data is None and root is not None:
        data_cfg = replace(data_cfg, root=root)
    try:
        dataset, _ = eval_dataset(data_cfg, meta.preprocess, "train" if data is None else "all", cfg.train.seed)
    except UserError as e:
        raise UserError(f"int8 calibration needs the checkpoint's training images ({data_cfg.source}): {e} "
                        "(pass --data to calibrate on other images of the same classes)") from None
    n = min(DEFAULT_CALIBRATION, len(dataset)) if n is None else n
    if len(dataset) < max(n, MIN_CALIBRATION):
        raise UserError(f"int8 calibration: {data_cfg.source} has only {len(dataset)} training images, "
                        f"--calibration-images asks for {n}; lower it (at least {MIN_CALIBRATION}) or pass "
                        "--data with more images")
    picks = torch.linspace(0, len(dataset) - 1, n).round().long()
    return torch.stack([dataset[int(i)][0] for i in picks])


def quantize_int8(ep: torch.export.ExportedProgram, calibration: torch.Tensor,
                  dynamic_shapes: object = None, batch: int = 32) -> torch.export.ExportedProgram:
    """PT2E int8 (XNNPACK quantizer, symmetric, per-channel) of an exported fp32 program."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    return _pt2e(ep, quantizer, calibration, dynamic_shapes, batch)


def quantize_int8_x86(ep: torch.export.ExportedProgram, calibration: torch.Tensor,
                      dynamic_shapes: object = None, batch: int = 32,
                      reduce_range: bool = False) -> torch.export.ExportedProgram:
    """PT2E static int8 for Inductor on x86 CPUs (torchao's X86InductorQuantizer, its default config) of an
    exported fp32 program. Importing the quantizer registers torchao's Inductor passes that lower the
    result to oneDNN int8 kernels; they run only when the program is compiled frozen, without grad.
    `reduce_range` (`int8_reduce_range()`): activations in 7 bits, 0-127, for int8 kernels without VNNI."""
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86

    config = x86.get_default_x86_inductor_quantization_config(reduce_range=reduce_range)
    quantizer = x86.X86InductorQuantizer().set_global(config)
    for name in single_channel_convolutions(ep):
        quantizer.set_module_name_qconfig(name, None)
    return _pt2e(ep, quantizer, calibration, dynamic_shapes, batch)


VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # torch's spelling (machine.cpu_flags)


def int8_reduce_range() -> bool:
    """Whether this CPU's int8 kernels need activations in 7 bits (torchao's `reduce_range`).

    oneDNN's int8 kernels without VNNI (AVX2, or an AVX-512 CPU held to AVX2) multiply uint8 activations by int8
    weights with vpmaddubsw, which adds each pair of products in 16 bits: 2 x 255 x 128 overflows them, and the
    sum saturates (measured, a random ResNet-18 at 32 px held to AVX2: its logits 0.016 off fp32's, against 0.006
    with VNNI). With activations at most 127 a pair stays within 2 x 127 x 128 = 32,512 < 32,767, so the sums are
    exact (the same net held to AVX2 gave the logits of its 7-bit quantization with VNNI, to the last bit at batch
    16, within 0.3% at batch 1) at the cost of one bit of activation resolution; the parity gate then judges the
    result as any int8 package. Needed where the CPU has no VNNI instruction, and where it has one that oneDNN may
    not use (held to AVX2), which the kernel probe finds (hardware.cpu_int8_matmul_exact). The probe alone is not
    enough: it checks an int8 x int8 matrix product, and on a real AVX2 AMD Zen 3 that product was exact, which
    says nothing of the uint8 x int8 convolutions."""
    from torchcls.machine import cpu_flags
    from torchcls.precision.hardware import cpu_int8_matmul_exact

    return not set(VNNI_FLAGS) & cpu_flags() or not cpu_int8_matmul_exact()


def single_channel_convolutions(ep: torch.export.ExportedProgram) -> list[str]:
    """Module names of the convolutions that read one input channel (a grey-scale stem), left in fp32.

    Measured (torch 2.14.1, torchao 0.18): AOTInductor's frozen int8 lowering of such a convolution, quantized
    by X86InductorQuantizer, computes something else than the quantized graph it was given: a
    ResNet-18 trained on Fashion-MNIST (1 channel, 28 px) agreed with its own int8 reference on 25% of images
    (with eager fp32 on 12%), and agreed exactly once its stem stayed fp32; the same net with 3 input channels
    was exact. Such a convolution does a small share of the work (one input channel)."""
    groups_at = {torch.ops.aten.conv2d.default: 6, torch.ops.aten.convolution.default: 8}  # its `groups` argument
    names = []
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in groups_at:
            continue
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None
        at = groups_at[node.target]
        groups = node.args[at] if len(node.args) > at else 1
        stack = node.meta.get("nn_module_stack") or {}
        if weight is not None and weight.dim() >= 3 and weight.shape[1] * groups == 1 and stack:
            names.append(list(stack.values())[-1][0])
    return names


def _pt2e(ep: torch.export.ExportedProgram, quantizer: Any, calibration: torch.Tensor, dynamic_shapes: object,
          batch: int) -> torch.export.ExportedProgram:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    with warnings_without(INT8_QUANTIZER):  # a max pool after a stem left in fp32 (torchcls.noise)
        prepared = prepare_pt2e(ep.module(), quantizer)
    with torch.no_grad():
        for start in range(0, len(calibration), batch):
            prepared(calibration[start:start + batch])
    converted = convert_pt2e(prepared)
    example = calibration[:2] if dynamic_shapes is not None else calibration[:1]
    with torch.no_grad():
        return torch.export.export(converted, (example,), dynamic_shapes=dynamic_shapes)


@torch.no_grad()
def _bounded_parity(reference: nn.Module, candidate: nn.Module, batches: Iterable[torch.Tensor],
                     bounds: tuple[float, float]) -> dict[str, Any]:
    """parity.compare of `candidate` against the fp32 `reference` on `batches`, plus the relative max |Δlogit|
    and whether both figures are inside `bounds` (relative max |Δlogit|, min top-1 agreement)."""
    ref, out = [], []
    for x in batches:
        ref.append(reference(x).float())
        out.append(candidate(x).float())
    if not ref:
        raise UserError("parity needs at least one input batch")
    ref_logits = torch.cat(ref)
    result = compare(ref_logits, torch.cat(out))
    rel = result["max_abs_diff"] / max(ref_logits.abs().max().item(), 1e-12)
    return result | {
        "max_abs_logit_diff": result["max_abs_diff"], "max_rel_logit_diff": rel,  # the names before compare()
        "bound_rel_logit_diff": bounds[0], "bound_top1_agreement": bounds[1],
        "passed": rel <= bounds[0] and result["top1_agreement"] >= bounds[1]}


def quantize_for_inference(model: nn.Module, precision: str, example_batches: Iterable[torch.Tensor] | torch.Tensor,
                           device: str | torch.device = "cpu", *, fp8_recipe: str = "tensorwise",
                           bounds: tuple[float, float] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Convert and verify in one call: returns the converted model and a report with the layer list and
    parity against the fp32 eager model (`bounds` default: PARITY_BOUNDS[precision]). Raises UserError
    when parity is outside its bound."""
    reference = copy.deepcopy(model).eval().to(device).float()
    result = apply_inference_precision(model, precision, device, fp8_recipe=fp8_recipe)
    if isinstance(example_batches, torch.Tensor):
        example_batches = [example_batches]
    batches = [x.to(device) for x in example_batches]
    parity = _bounded_parity(reference, result.model.eval(), batches, bounds or PARITY_BOUNDS[precision])
    if not parity["passed"]:
        raise UserError(f"{precision} inference failed parity against fp32: max |Δlogit| {parity['max_abs_diff']:.4g} "
                        f"(relative {parity['max_rel_logit_diff']:.3g}, bound {parity['bound_rel_logit_diff']}), "
                        f"top-1 agreement {parity['top1_agreement']:.3f} (bound {parity['bound_top1_agreement']}); "
                        "use a higher precision for this model")
    return result.model, result.summary() | {"parity": parity}


def heldout_batches(checkpoint: str, n: int = 64, batch_size: int = 32) -> list[torch.Tensor]:
    """Up to `n` real held-out images of a checkpoint's data (the same images export's parity uses:
    parity.held_out_images), preprocessed as at evaluation, in batches: the inputs parity is measured on."""
    images, _ = held_out_images(read_meta(resolve_checkpoint(checkpoint)), n)
    return list(images.split(batch_size))

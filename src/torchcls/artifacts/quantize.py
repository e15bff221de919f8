"""Int8 for ExecuTorch/XNNPACK through the PT2E flow: the exported graph is annotated by XNNPACK's
quantizer (symmetric, per-channel weights, int8 activations), observed on real training images of
the checkpoint's own data, converted, and exported again (same dynamic batch dimension).

Calibration uses real images on purpose: activation ranges from random or synthetic inputs are
wrong for a trained network (and random-init BatchNorm statistics are degenerate).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torchcls.config import Config
from torchcls.data import eval_dataset
from torchcls.errors import UserError
from torchcls.checkpoint.files import CheckpointMeta

QUANTIZE = ("none", "int8")
MIN_CALIBRATION = 16  # fewer images give activation ranges that one outlier image decides
DEFAULT_CALIBRATION = 256
INT8_MIN_AGREEMENT = 0.95


def calibration_images(meta: CheckpointMeta, n: int | None, data: str | None = None,
                       root: str | None = None) -> torch.Tensor:
    """`n` images spread over the training split of the checkpoint's data, preprocessed as at
    evaluation (no augmentation: the program sees evaluation-style inputs). `n=None`: up to
    DEFAULT_CALIBRATION, as many as the split has."""
    if n is not None and n < MIN_CALIBRATION:
        raise UserError(f"--calibration-images {n}: int8 calibration needs at least {MIN_CALIBRATION} images")
    cfg = Config.from_dict(meta.config, origin="checkpoint metadata")
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
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(ep.module(), quantizer)
    with torch.no_grad():
        for start in range(0, len(calibration), batch):
            prepared(calibration[start:start + batch])
    converted = convert_pt2e(prepared)
    example = calibration[:2] if dynamic_shapes is not None else calibration[:1]
    with torch.no_grad():
        return torch.export.export(converted, (example,), dynamic_shapes=dynamic_shapes)

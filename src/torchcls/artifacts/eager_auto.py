"""--precision auto for a checkpoint run eagerly (predict, serve): the reduced precision the rule picks (bf16
where the hardware computes it natively) runs only where it agrees with fp32 on held-out images as an
exported artifact of that precision must; otherwise, or with no held-out images on this machine, fp32, and
the choice says why.

The check runs both precisions on AUTO_CHECK_IMAGES held-out images (seconds: the held-out split is built
first), so it is made once per checkpoint content and machine and its measurement remembered
(auto_check_store: the user's own cache folder, never the run dir). The bound is applied at use, so a
stricter DEFAULT_MIN_AGREEMENT holds for measurements made before it. The choice's reason says whether
the measurement was made now or taken from the cache, which is the one line predict and serve log.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from torchcls.artifacts import auto_check_store as store
from torchcls.artifacts import parity
from torchcls.checkpoint.files import CheckpointMeta
from torchcls.errors import UserError
from torchcls.precision.hardware import PrecisionChoice, choose_precision
from torchcls.precision.inference import eager_for_inference

CHECK_CHUNK = 32


def fp32_only(model: nn.Module) -> str:
    """Why `model` runs in fp32 whatever --precision auto would pick ('' = it need not)."""
    from torchcls.models.early_exit import EarlyExitNet

    return "early-exit models run in fp32, as they export" if isinstance(model, EarlyExitNet) else ""


def eager_model(model: nn.Module, meta: CheckpointMeta, requested: str,
                device: torch.device) -> tuple[nn.Module, PrecisionChoice]:
    """`model` (fp32 as loaded, on the CPU) ready for eager inference on `device` in `requested` (auto, fp32 or
    bf16). An explicit precision runs as asked; auto as the module docstring says."""
    rule = choose_precision(requested, device, kind="inference") if requested == "auto" else None
    if rule is None or rule.precision == "fp32" or fp32_only(model):
        return eager_for_inference(model.to(device), requested, device, fp32_only(model))
    key = {"weights_sha256": store.weights_digest(model, meta.to_json()), "precision": rule.precision}
    key |= store.machine_key(device)
    measured, why_not = store.recall(key)
    if measured is not None:
        return _decide(model.to(device), None, device, rule, measured, f"cached check, {store.cache_folder()}")
    fp32 = model.to(device).eval()
    reduced, _ = eager_for_inference(copy.deepcopy(fp32), "auto", device)
    try:
        measured = measure(fp32, reduced, meta, device)
    except UserError as e:  # not remembered: the data may be here next time
        return fp32, PrecisionChoice("auto", "fp32", f"{rule.reason}, but no held-out images here to check "
                                     f"{rule.precision} against fp32 ({str(e)[:160]}): fp32 runs")
    return _decide(fp32, reduced, device, rule, measured, f"checked now, {why_not}; {store.remember(key, measured)}")


@torch.inference_mode()
def measure(fp32: nn.Module, reduced: nn.Module, meta: CheckpointMeta, device: torch.device) -> store.Measured:
    """Top-1 agreement of `reduced` with `fp32` on the checkpoint's held-out images (UserError: none here)."""
    images, _ = parity.held_out_images(meta, parity.AUTO_CHECK_IMAGES)
    ref, out = [], []
    for start in range(0, len(images), CHECK_CHUNK):
        x = images[start:start + CHECK_CHUNK].to(device)
        ref.append(fp32(x).float().cpu())
        out.append(reduced(x).float().cpu())
    return store.Measured(parity.compare(torch.cat(ref), torch.cat(out))["top1_agreement"], len(images))


def _decide(fp32: nn.Module, reduced: nn.Module | None, device: torch.device, rule: PrecisionChoice,
            measured: store.Measured, source: str) -> tuple[nn.Module, PrecisionChoice]:
    """fp32 or the reduced model (made from `fp32` when not given) by `measured` against today's bound."""
    needed = parity.DEFAULT_MIN_AGREEMENT[rule.precision]
    checked = (f"{rule.precision} agrees with fp32 on {measured.top1_agreement:.1%} of {measured.n} held-out "
               "images")
    if measured.top1_agreement >= needed:
        if reduced is None:
            reduced, _ = eager_for_inference(fp32, "auto", device)
        return reduced, PrecisionChoice("auto", rule.precision, f"{rule.reason}; {checked} ({source})")
    return fp32.eval(), PrecisionChoice("auto", "fp32", f"{rule.reason}, but {checked} ({needed:.0%} needed): "
                                        f"fp32 runs ({source})")

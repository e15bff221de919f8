"""What `torchcls export` prints beyond its common line (from parity.json): the ExecuTorch lowering
report (and for int8, the accuracy of the int8 program and of the fp32 model on the same held-out
images), and for early-exit models the images and parity per exit."""

from __future__ import annotations

from typing import Any


def describe(parity: dict[str, Any]) -> str:
    """The target- and model-specific part of the export report, for the terminal ('' when none)."""
    lines = _executorch_lines(parity) if "executorch" in parity else []
    if "early_exit" in parity:
        lines += _early_exit_lines(parity["early_exit"])
    return "\n".join(lines)


def _executorch_lines(parity: dict[str, Any]) -> list[str]:
    et = parity["executorch"]
    lines = [f"program: {et['program_bytes'] / 1e6:.2f} MB, backend {et['backend']}, quantize {et['quantize']}, "
             f"{et['delegated_subgraphs']} delegated subgraph(s)",
             "delegated ops: " + (", ".join(f"{k}×{v}" for k, v in et["delegated_ops"].items()) or "none"),
             "left to portable kernels: " + (", ".join(f"{k}×{v}" for k, v in et["non_delegated_ops"].items())
                                             or "none")]
    if "int8_accuracy" in parity:
        drop = parity["accuracy_drop_pt"]  # negative: int8 did better on these images (noise of a small sample)
        change = f"{drop:.2f} pt lower" if drop > 0 else f"{-drop:.2f} pt higher" if drop < 0 else "the same"
        lines.append(f"held-out accuracy: int8 {parity['int8_accuracy']:.4f}, fp32 {parity['fp32_accuracy']:.4f} "
                     f"(int8 {change})")
    return lines + [f"note: {n}" for n in et["notes"]]


def _early_exit_lines(ee: dict[str, Any]) -> list[str]:
    lines = [f"early exit (threshold {ee['threshold']}): parity images per exit, taken in turn from each exit of "
             f"{ee['held_out_pool']} held-out images"]
    for e in ee["exits"]:
        lines.append(f"  exit {e['exit']}: " + (
            f"{e['images']} images, top-1 agreement {e['top1_agreement']:.4f}, same exit {e['exit_agreement']:.4f}, "
            f"max |dlogit| {e['max_abs_diff']:.3g}" if e["images"] else "never taken by these held-out images"))
    return lines

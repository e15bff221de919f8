"""What `torchcls export --target executorch` prints: the lowering report and, for int8, the accuracy
of the int8 program and of the fp32 model on the same held-out images (from parity.json)."""

from __future__ import annotations

from typing import Any


def describe(parity: dict[str, Any]) -> str:
    """The export report's ExecuTorch part, for the terminal."""
    et = parity["executorch"]
    lines = [f"program: {et['program_bytes'] / 1e6:.2f} MB, backend {et['backend']}, quantize {et['quantize']}, "
             f"{et['delegated_subgraphs']} delegated subgraph(s)",
             "delegated ops: " + (", ".join(f"{k}×{v}" for k, v in et["delegated_ops"].items()) or "none"),
             "left to portable kernels: " + (", ".join(f"{k}×{v}" for k, v in et["non_delegated_ops"].items())
                                             or "none")]
    if "int8_accuracy" in parity:
        lines.append(f"held-out accuracy: int8 {parity['int8_accuracy']:.4f}, fp32 {parity['fp32_accuracy']:.4f} "
                     f"(drop {parity['accuracy_drop_pt']:.2f} pt)")
    lines += [f"note: {n}" for n in et["notes"]]
    return "\n".join(lines)

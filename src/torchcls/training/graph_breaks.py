"""Graph-break report: how many graphs torch.compile makes of a model, and why it breaks.

`torch._dynamo.explain` traces the model once on a real example batch. A compiled model
with breaks runs as several graphs with eager Python between them (less fusion, more
overhead); the reasons (e.g. a Python `if` on a tensor, `.item()`) say what to rewrite.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from torchcls.run_files import write_text_atomic


@dataclass
class GraphBreakReport:
    graphs: int
    graph_breaks: int
    ops: int
    reasons: list[str] = field(default_factory=list)  # "reason (file:line)", one per break, de-duplicated

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def explain_graph_breaks(model: nn.Module, example: torch.Tensor) -> GraphBreakReport:
    """Trace `model(example)` with dynamo; the model's buffers and the RNG are left as they were."""
    from torch._dynamo.utils import counters

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}  # BN stats move in train mode
    rng = torch.get_rng_state()
    counters["graph_break"].clear()
    try:
        out = torch._dynamo.explain(model)(example)
        # explain's own break_reasons can come back empty; dynamo's counters keep every reason.
        reasons = [_reason(r.reason, r.user_stack) for r in out.break_reasons]
        reasons += [_reason(text, None) for text in counters["graph_break"]]
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(rng)
        torch._dynamo.reset()
    reasons = list(dict.fromkeys(reasons))
    return GraphBreakReport(out.graph_count, out.graph_break_count, out.op_count, reasons)


def report_graph_breaks(model: nn.Module, dataset, run_path: Path, device: torch.device,
                        memory_format: torch.memory_format) -> GraphBreakReport:
    """`torchcls train --compile`: write graph_breaks.json; print the breaks when there are any."""
    from torchcls.console import console

    n = min(2, len(dataset))
    example = torch.stack([dataset[i][0] for i in range(n)]).to(device, memory_format=memory_format)
    report = explain_graph_breaks(model, example)
    write_text_atomic(run_path / "graph_breaks.json", report.to_json())
    if report.graph_breaks:
        console.print(f"[yellow]torch.compile splits this model into {report.graphs} graphs "
                      f"({report.graph_breaks} graph break(s)); each break runs Python eagerly between graphs:[/]")
        for reason in report.reasons:
            console.print(f"  [yellow]- {reason}[/]")
    else:
        console.print(f"torch.compile: {report.graphs} graph, no graph breaks")
    return report


def _reason(text: str | None, stack) -> str:
    frame = stack[-1] if stack else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    lines = [line.strip() for line in (text or "unknown").splitlines() if line.strip()]
    detail = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
    return f"{lines[0]}{': ' + detail.removeprefix('Explanation: ') if detail else ''}{where}"

"""Small HTML helpers shared by the report sections (everything escaped; images embedded)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from torchcls import run_files
from torchcls.errors import UserError
from torchcls.io_files import SMALL_JSON_BYTES


def esc(value: Any) -> str:
    return html.escape(str(value))


def img(path: Path, max_bytes: int = SMALL_JSON_BYTES) -> str:
    """`path` (a figure of the run dir) embedded; a link, anything but a regular file, or a file over
    `max_bytes` is named instead."""
    try:
        data = base64.b64encode(run_files.read_bytes(path, max_bytes=max_bytes, what="figure")).decode()
    except UserError as e:
        return f"<p class='notrun'>figure refused: {esc(e)}</p>"
    return f'<img alt="{esc(path.stem)}" src="data:image/png;base64,{data}">'


def table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def kpis(items: list[tuple[str, Any]]) -> str:
    return "".join(f'<div class="kpi">{esc(k)}<b>{esc(v)}</b></div>' for k, v in items)


def status(s: str) -> str:
    return f'<span class="st-{esc(s)}">{esc(s)}</span>'

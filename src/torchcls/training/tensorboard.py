"""TensorBoard scalars beside metrics.jsonl (--tensorboard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.extras import missing_extra
from torchcls.run_files import sub_dir


def open_writer(run_path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise missing_extra("tensorboard", "--tensorboard", "tensorboard") from None
    return SummaryWriter(str(sub_dir(run_path / "tensorboard", "the tensorboard folder")))  # (not a link)


def write_scalars(writer, record: dict[str, Any]) -> None:
    if writer is None:
        return
    for key, value in record.items():
        if key not in ("kind", "epoch", "step") and isinstance(value, (int, float)):
            writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

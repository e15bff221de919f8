"""What a governed run lets out: the sample grid (report and TensorBoard) and sample file names
in the skipped-files list, each passed through the output hooks; restricted samples that no
hook redacted are withheld (and counted), never written."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchcls import run_files
from torchcls.governance.hooks import Hook, OutputItem, SampleInfo, run_output_hooks
from torchcls.run_files import replace_file, write_text_atomic
from torchcls.training.rundir import read_skipped


def sample_grid(load: Callable[[int], Any], info: Callable[[int], SampleInfo], label: Callable[[int], str],
                count: int, hooks: list[Hook], n: int, seed: int, png: Path, tb_dir: Path | None) -> dict[str, int]:
    """Write up to n of `count` samples as a labelled grid to `png` (and to TensorBoard); returns counts."""
    import torch

    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(count, generator=g)[:n].tolist()
    tiles, titles, counts = [], [], {"shown": 0, "redacted": 0, "withheld": 0}
    for i in order:
        item = run_output_hooks(hooks, OutputItem("sample_image", info(i), load(i)))
        if item is None:
            counts["withheld"] += 1
            continue
        counts["redacted" if item.redacted else "shown"] += 1
        tiles.append(item.value)
        titles.append("redacted" if item.redacted else label(i))
    if tiles:
        _save_grid(tiles, titles, png)
        if tb_dir is not None:
            _tensorboard_images(tiles, tb_dir)
    return counts


def _as_rgb(x):
    import torch

    x = x if x.shape[0] == 3 else x.expand(3, -1, -1)
    return torch.nn.functional.interpolate(x[None].float(), size=(64, 64), mode="nearest")[0].to(torch.uint8)


def _save_grid(tiles: list, titles: list[str], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(8, len(tiles))
    rows = (len(tiles) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(1.4 * cols, 1.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, tile, title in zip(axes.flat, tiles, titles):
        ax.imshow(_as_rgb(tile).permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(title, fontsize=7)
    fig.tight_layout()
    try:
        replace_file(png, lambda tmp: fig.savefig(tmp, dpi=100))  # a run dir's: never written through a link
    finally:
        plt.close(fig)


def _tensorboard_images(tiles: list, tb_dir: Path) -> None:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_files.sub_dir(tb_dir, "the tensorboard folder")))
    writer.add_images("samples", torch.stack([_as_rgb(t) for t in tiles]), 0, dataformats="NCHW")
    writer.close()


def redact_skipped(path: Path, lookup: Callable[[str], SampleInfo | None], hooks: list[Hook],
                   extra: list[tuple[SampleInfo, str]]) -> int:
    """Rewrite skipped_files.json so restricted samples' file names pass the output hooks; returns
    how many names were redacted or withheld."""
    entries = read_skipped(path)  # (the resume checked it too)
    entries += [{"file": s.id, "reason": reason, "_info": s} for s, reason in extra]
    out, changed = [], 0
    for e in entries:
        info = e.pop("_info", None) or lookup(e["file"])
        if info is None:
            out.append(e)
            continue
        item = run_output_hooks(hooks, OutputItem("file_name", info, e["file"]))
        if item is None or item.redacted:
            changed += 1
        reason = e["reason"]
        if item is None or item.redacted:  # a decoder's message may quote the file name too
            reason = reason.replace(e["file"], "…").replace(Path(e["file"]).name, "…")
        out.append({"file": item.value if item is not None else "[withheld restricted sample]", "reason": reason})
    if out:
        write_text_atomic(path, json.dumps({"skipped_files": out}, indent=2))
    return changed

"""`torchcls demo`: the built-in SmallNet trained on the real MNIST-5k digits, evaluated and reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.config import Config
from torchcls.console import console
from torchcls.errors import UserError
from torchcls.made_dirs import move_aside
from torchcls.options import DemoOptions as _D  # the defaults, declared once


def demo_config(out_dir: str = "runs", name: str = "demo", epochs: int | None = None, threads: int = 0) -> Config:
    cfg = Config()
    cfg.data.source = "mnist-5k"
    cfg.model.name = "smallnet"
    cfg.train.epochs = epochs or 8
    cfg.train.threads = threads
    cfg.run.out_dir, cfg.run.name = out_dir, name
    return cfg


def demo(out_dir: str = _D.out_dir, name: str = _D.name, epochs: int | None = None,
         threads: int = _D.threads) -> dict[str, Any]:
    from torchcls.evaluation import evaluate
    from torchcls.training import train

    cfg = demo_config(out_dir, name, epochs, threads)
    _start_fresh(Path(out_dir) / name)
    console.print(f"[bold]torchcls demo[/]: training {cfg.model.name} on {cfg.data.source} "
                  f"({cfg.train.epochs} epochs, 80/20 seeded split)")
    result = train(cfg)
    ev = evaluate(result.best_checkpoint)
    console.print(f"\n[bold green]held-out top-1 {ev['top1']:.2%}[/] (top-5 {ev['top5']:.2%}, {ev['n']} images)")
    console.print(f"report: {result.run_dir / 'report.html'}")
    return ev


def _start_fresh(run: Path) -> None:
    """The demo always starts a new run: an earlier one (or whatever --out-dir/--name names) is moved aside,
    never deleted, since a name alone says nothing about whose files are there."""
    if not run.exists() and not run.is_symlink():
        return
    try:
        aside = move_aside(run, "previous")
    except OSError as e:
        raise UserError(f"{run} exists and cannot be moved aside ({e.strerror}): choose another --name or "
                        "--out-dir for the demo") from None
    console.print(f"[yellow]{run} existed: moved aside to {aside.name} (nothing removed)[/]")

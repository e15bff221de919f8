"""Optional parts of torchcls and the packages they need: one place that says which extra a feature
needs and the install command that works from where torchcls runs.

A source checkout (`make demo`, `pip install -e .`) needs `pip install -e '.[serve]'` in that checkout;
an installed wheel needs `pip install 'torchcls[serve]'`. The pip shown is the one of the Python that runs
torchcls (a venv's, even when that venv is not activated).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from torchcls.errors import UserError

# extra -> what it enables (README's table says the same)
EXTRAS = {
    "serve": "torchcls serve (FastAPI, Hypercorn)",
    "export": "--target onnx and .onnx artifacts (onnx, onnxscript, onnxruntime; openvino for --runtime openvino)",
    "edge": "--target executorch and .pte programs (executorch, torchao)",
    "precision": "--precision fp8, int8/fp8 inference quantization, int8 .pt2 export (torchao)",
    "tracking": "--tracking mlflow (mlflow-skinny, SQLAlchemy)",
    "tensorboard": "--tensorboard",
    "explain": "torchcls explain (captum)",
    "hf": "--data hf:PATH (datasets)",
}


def source_checkout() -> Path | None:
    """The checkout torchcls runs from (an editable install or src/ on the path), None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and (root / "src" / "torchcls").is_dir() and 'name = "torchcls"' in pyproject.read_text():
        return root
    return None


def _pip() -> str:
    """`pip` when the pip on PATH belongs to this Python; else this Python's own pip script (`.venv/bin/pip` from
    the checkout), or `<this python> -m pip`; relative to the working directory when below it."""
    here = Path(os.path.abspath(sys.executable)).parent  # a venv's python is a symlink: compare folders, not targets
    on_path = shutil.which("pip")
    if on_path and Path(os.path.abspath(on_path)).parent == here:
        return "pip"
    if (here / "pip").is_file():
        return _short(here / "pip")
    return f"{_short(Path(sys.executable))} -m pip"


def _short(path: Path) -> str:
    try:
        shown = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return shown if not shown.startswith("..") else str(path)


def install_command(extra: str) -> str:
    """The command that installs `extra` for the torchcls that is running."""
    root = source_checkout()
    if root is None:
        return f"{_pip()} install 'torchcls[{extra}]'"
    here = Path.cwd().resolve() == root
    return f"{_pip()} install -e '{'.' if here else root}[{extra}]'"


def missing_extra(extra: str, what: str, missing: str | None = None, otherwise: str | None = None) -> UserError:
    """The error for a feature whose optional packages are not installed; `otherwise`: what else the user can do."""
    gone = f" ({missing} is not installed)" if missing else ""
    return UserError(f"{what} needs the '{extra}' extra{gone}: {install_command(extra)}"
                     + (f"; or {otherwise}" if otherwise else ""))

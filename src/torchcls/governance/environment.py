"""What the audit log records about the software: code version and package versions."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

from torchcls.version import __version__

PACKAGES = ("torch", "torchvision", "timm", "safetensors", "numpy", "pillow", "torchmetrics", "mlxtend")


def code_version() -> str:
    """`git describe` of the torchcls source tree when it is a checkout, else the package version."""
    src = Path(__file__).resolve().parent.parent  # src/torchcls
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=src, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return f"torchcls {__version__} git {out.stdout.strip()}"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"torchcls {__version__}"


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions

"""torchcls as `pip install torchcls` leaves it: every module imports with the core dependencies alone, and
the console script names the torch it runs on. `make test` also runs this file in .venv-lowest (the lowest
supported torch, installed first as a user would have it; see the Makefile's test-lowest)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torchcls

# The packages that exist to drive an optional extra and import it at the top (pip install 'torchcls[serve]');
# every other module must import without any extra: heavy optional libraries are imported where they are used.
NEEDS_ITS_EXTRA = {"torchcls.serve": "serve"}


def _modules() -> list[str]:
    # __main__ runs the CLI when imported
    return [m.name for m in pkgutil.walk_packages(torchcls.__path__, "torchcls.") if m.name != "torchcls.__main__"]


def test_every_module_imports_without_optional_extras():
    failed = []
    for name in _modules():
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            owner = next((pkg for pkg in NEEDS_ITS_EXTRA if name == pkg or name.startswith(pkg + ".")), None)
            if owner is None or importlib.util.find_spec(missing) is not None:
                failed.append(f"{name}: {e!r}")
        except Exception as e:  # every module's failure is listed, not only the first
            failed.append(f"{name}: {e!r}")
    assert not failed, "modules that do not import here:\n" + "\n".join(failed)
    assert len(_modules()) > 100  # the walk found the package, not an empty path


def test_console_script_reports_the_installed_torch():
    script = Path(sys.executable).parent / "torchcls"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith(f"torchcls {torchcls.__version__} (torch {version('torch')}, Python "), out

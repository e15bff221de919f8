"""Lazy public names: a package's API is imported on first use, so `import torchcls` (and `torchcls --help`)
does not pay for importing torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_api(namespace: dict[str, Any], table: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `namespace` (the package's globals()) that imports `table[name]` on first
    use and keeps the value in the namespace. Keeping it matters where a function shares its name with the
    submodule that defines it (torchcls.demo): importing the submodule sets the package attribute to the
    module, and without this the second `torchcls.demo` would be the module, not the function."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value
        return value

    return __getattr__

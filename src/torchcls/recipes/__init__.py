"""Named recipes: TOML files shipped with torchcls that a run starts from (`torchcls train --recipe NAME`).

A recipe is a config file like any `--config` file (sections [data], [model], ...) plus two
optional keys that are not training options: `description` (one line, shown by `--recipe list`)
and an [evaluate] table with the evaluation the recipe's figures were measured with (e.g.
`tta = "flip"`), which `torchcls evaluate` does not apply by itself: the user passes it, and
benchmarks read it from here. Options are layered: recipe, then --config FILE, then flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchcls.config import Config
from torchcls.errors import UserError
from torchcls.toml_compat import tomllib

RECIPES_DIR = Path(__file__).parent
NOT_OPTIONS = ("description", "evaluate")  # recipe keys that are not training options


def names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def _raw(name: str) -> dict[str, Any]:
    path = RECIPES_DIR / f"{name}.toml"
    if name not in names():
        raise UserError(f"--recipe: no recipe named {name!r}; the recipes are: {', '.join(names())} "
                        "(`torchcls train --recipe list` describes them)")
    return tomllib.loads(path.read_text())


def load_recipe(name: str) -> Config:
    """The training config of recipe `name` (defaults for every option it does not set)."""
    raw = {k: v for k, v in _raw(name).items() if k not in NOT_OPTIONS}
    return Config.from_dict(raw, origin=f"recipe {name}")


def recipe_evaluation(name: str) -> dict[str, Any]:
    """The evaluation options the recipe was measured with (its [evaluate] table; {} when none)."""
    return dict(_raw(name).get("evaluate", {}))


def describe() -> str:
    """One line per recipe: its name and description."""
    return "\n".join(f"{n:<16} {_raw(n).get('description', '')}" for n in names())

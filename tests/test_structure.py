"""The shape of the code base, checked by reading the source with `ast` (nothing is imported).

- No import cycle between torchcls modules. Every `import`/`from ... import` of a torchcls
  module counts, at module level and inside functions (a function-level import only moves a
  cycle to run time), and under `if TYPE_CHECKING:` too: a type-only import never runs, but it
  still ties the two modules together (neither can be read, tested or moved without the other)
  and is one annotation away from a runtime cycle (data/loaders <-> data/transforms was one). Importing
  `torchcls.a.b` also runs `torchcls/a/__init__.py`, so that package is an edge too (except the
  importer's own ancestors, which Python has already started). `from pkg import name` goes to
  the sub-module `pkg.name` when there is one, else to the module named for `name` in the
  package's lazy table (`_API` in torchcls/__init__.py), else to the package's `__init__`.
- No function over MAX_FUNCTION_LINES lines (a function should fit on a screen).
- cli.py stays a thin shell.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT_PACKAGE = "torchcls"
MAX_FUNCTION_LINES = 80
MAX_CLI_LINES = 220


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lazy: dict[str, str] = field(default_factory=dict)  # name -> module, from a package's `_API` table


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    """The table a lazy package resolves names through: a module-level dict of string constants whose
    values are all torchcls module names (`_API = {"name": "torchcls.module", ...}`)."""
    table: dict[str, str] = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict) and value.keys and all(
                isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Constant)
                and isinstance(v.value, str) and v.value.startswith(ROOT_PACKAGE + ".")
                for k, v in zip(value.keys, value.values, strict=True)):
            table.update({k.value: v.value for k, v in zip(value.keys, value.values, strict=True)})
    return table


def load_modules() -> dict[str, Module]:
    modules = {}
    for path in sorted((SRC / ROOT_PACKAGE).rglob("*.py")):
        name, is_package = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        modules[name] = Module(name, path, is_package, tree, _lazy_table(tree) if is_package else {})
    return modules


def _import_nodes(node: ast.AST):
    """Every Import/ImportFrom below node: module level, in functions, under `if TYPE_CHECKING:` alike."""
    return (child for child in ast.walk(node) if isinstance(child, (ast.Import, ast.ImportFrom)))


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: Module, modules: dict[str, Module]) -> set[str]:
    """The torchcls modules that `module` names in its imports (before adding packages' __init__)."""
    found = set()
    for node in _import_nodes(module.tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _absolute(module, node)
            names = []
            for alias in node.names:
                package = modules.get(base)
                if f"{base}.{alias.name}" in modules:
                    names.append(f"{base}.{alias.name}")
                elif package is not None and alias.name in package.lazy:
                    names.append(package.lazy[alias.name])
                else:
                    names.append(base)
        for name in names:
            # `import torchcls.a.b.c` where c is a class: the deepest existing module
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.split(".")[0] == ROOT_PACKAGE and name:
                found.add(name)
    return found


def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in modules.values():
        own_ancestors = {".".join(module.name.split(".")[:i]) for i in range(1, module.name.count(".") + 1)}
        if module.is_package:
            own_ancestors.add(module.name)
        edges = set()
        for target in _targets(module, modules):
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[module.name] = {t for t in edges if t in modules and t not in own_ancestors and t != module.name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> b -> ... -> a) per strongly connected component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first search)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if nxt not in parents:
                    parents[nxt] = node
                    next_frontier.append(nxt)
        frontier = next_frontier
    return component


def long_functions(modules: dict[str, Module], limit: int) -> list[str]:
    found = []

    def walk(node: ast.AST, prefix: str, module: Module) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > limit:
                        rel = module.path.relative_to(SRC.parent)
                        found.append(f"{rel}:{child.lineno} {qualname}: {lines} lines")
                walk(child, qualname + ".", module)
            else:
                walk(child, prefix, module)

    for module in modules.values():
        walk(module.tree, "", module)
    return found


# --- the checker checks itself on small made-up graphs and sources ---

def test_cycle_finder_names_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_resolved_through_packages(tmp_path):
    def module(name: str, source: str, is_package: bool = False) -> Module:
        tree = ast.parse(source)
        return Module(name, tmp_path, is_package, tree, _lazy_table(tree) if is_package else {})

    modules = {m.name: m for m in [
        module("torchcls", '_API = {"train": "torchcls.training.loop"}', is_package=True),
        module("torchcls.training", "from torchcls.training.loop import train", is_package=True),
        module("torchcls.training.loop", "from . import optim\ndef f():\n    from torchcls.data import x\n"),
        module("torchcls.training.optim", "from typing import TYPE_CHECKING\n"
                                          "if TYPE_CHECKING:\n    from torchcls.training.loop import train\n"),
        module("torchcls.data", "import torch", is_package=True),
        module("torchcls.cli", "from torchcls import train\nimport torchcls.data.missing_name\n"),
    ]}
    graph = import_graph(modules)
    assert graph["torchcls.training.loop"] == {"torchcls.training.optim", "torchcls.data"}
    assert graph["torchcls.training.optim"] == {"torchcls.training.loop"}  # a type-only import ties them too
    assert graph["torchcls.training"] == {"torchcls.training.loop"}
    assert graph["torchcls.cli"] == {"torchcls.training", "torchcls.training.loop", "torchcls.data"}


# --- the code base ---

def test_no_import_cycles():
    graph = import_graph(load_modules())
    found = cycles(graph)
    if found:
        pytest.fail("import cycles in src/torchcls (break each one):\n" + "\n".join(
            " -> ".join(c) + _rest_of_component(c, graph) for c in found), pytrace=False)


def _rest_of_component(cycle: list[str], graph: dict[str, set[str]]) -> str:
    """The other modules tangled with this cycle (its strongly connected component)."""
    reach = {cycle[0]}
    frontier = [cycle[0]]
    while frontier:
        frontier = [n for node in frontier for n in graph[node] if n not in reach and not reach.add(n)]
    tangled = sorted(n for n in reach if n not in cycle and cycle[0] in _reachable(n, graph))
    return f"  (also in the circle: {', '.join(tangled)})" if tangled else ""


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, frontier = {start}, [start]
    while frontier:
        frontier = [n for node in frontier for n in graph[node] if n not in seen and not seen.add(n)]
    return seen


def test_no_function_over_80_lines():
    found = long_functions(load_modules(), MAX_FUNCTION_LINES)
    if found:
        pytest.fail(f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(found), pytrace=False)


def test_cli_is_thin():
    lines = len((SRC / ROOT_PACKAGE / "cli.py").read_text().splitlines())
    assert lines <= MAX_CLI_LINES, f"src/torchcls/cli.py has {lines} lines (at most {MAX_CLI_LINES}): move logic out"

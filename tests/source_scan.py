"""The scan behind tests/test_no_code_from_files.py: where a module's source can turn a file's bytes into
code. Names are resolved through the module's imports (`from pickle import loads as l; l(b)` is
`pickle.loads`); each finding is (line, enclosing top-level function or class, what)."""

from __future__ import annotations

import ast

# References that unpickle or load code, by their qualified name (aliases resolved).
BANNED = {"pickle.load", "pickle.loads", "pickle.Unpickler", "pickle._Unpickler", "_pickle.load", "_pickle.loads",
          "_pickle.Unpickler", "marshal.load", "marshal.loads", "shelve.open", "dill.load", "dill.loads",
          "joblib.load", "builtins.exec", "builtins.eval", "pkgutil.resolve_name", "runpy.run_path",
          "runpy.run_module", "importlib.util.spec_from_file_location", "importlib.machinery.SourceFileLoader",
          "importlib.metadata.entry_points", "torch.distributed.checkpoint.FileSystemReader",
          "torch.distributed.checkpoint.filesystem.FileSystemReader"}
DYNAMIC_IMPORTS = {"importlib.import_module", "builtins.__import__", "importlib.__import__"}
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
DCP_LOADS = {"torch.distributed.checkpoint.load", "torch.distributed.checkpoint.state_dict_loader.load"}


class _Scan(ast.NodeVisitor):
    """Findings (line, function, what) in one module; names are resolved through its imports."""

    def __init__(self) -> None:
        self.alias: dict[str, str] = {"exec": "builtins.exec", "eval": "builtins.eval",
                                      "__import__": "builtins.__import__"}
        self.found: list[tuple[int, str, str]] = []
        self.scope = ["<module>"]
        self.checked: set[int] = set()  # Attribute/Name nodes already judged as the callee of a call

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            self.alias[a.asname or a.name] = f"{node.module}.{a.name}"

    def _def(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _def

    def qualname(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.alias.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def flag(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, self.scope[1] if len(self.scope) > 1 else "<module>", what))

    def visit_Call(self, node: ast.Call) -> None:
        name = self.qualname(node.func)
        if name in DYNAMIC_IMPORTS and not (node.args and isinstance(node.args[0], ast.Constant)):
            self.flag(node, f"{name}(<computed name>)")
        if name in TORCH_LOADS:
            self.checked.add(id(node.func))
            weights_only = [k.value for k in node.keywords if k.arg == "weights_only"]
            if not (weights_only and isinstance(weights_only[0], ast.Constant) and weights_only[0].value is True):
                self.flag(node, f"{name} without weights_only=True")
        if name in DCP_LOADS and not any(k.arg == "storage_reader" for k in node.keywords):
            self.flag(node, "dcp.load with its default (pickle) FileSystemReader")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._reference(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self._reference(node)

    def _reference(self, node: ast.AST) -> None:
        name = self.qualname(node)
        if name in BANNED or (name in TORCH_LOADS and id(node) not in self.checked):
            self.flag(node, name)


def scan_source(text: str) -> list[tuple[int, str, str]]:
    scan = _Scan()
    tree = ast.parse(text)
    for node in ast.walk(tree):  # imports first, wherever they are: an alias is known before its use
        if isinstance(node, ast.Import | ast.ImportFrom):
            scan.visit(node)
    scan.visit(tree)
    return sorted(set(scan.found))

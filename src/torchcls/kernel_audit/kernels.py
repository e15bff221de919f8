"""`torchcls audit kernels`: custom ops, their traceability and opcheck, GPU binaries and Triton kernels.

The verdict is for CI: any failed check makes `passed` false (exit code 1); warnings
(e.g. no CUDA kernel) are listed with what to do but do not fail the audit.

What is audited is what the user's code registered: the namespaces that --import and the --model's own
code add, the custom ops its graph calls, or --namespace. Operators of the libraries torchcls itself
runs on (torchvision's nms, roi_align, ...; torchao's when loaded) are their maintainers' to test: they
are listed as context with their op count, and audited only when asked for with --namespace.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchcls.errors import UserError
from torchcls.run_files import write_text_atomic


@dataclass
class KernelAudit:
    imports: list[str]
    device: dict[str, Any]
    ops: list[dict[str, Any]] = field(default_factory=list)
    binaries: list[dict[str, Any]] = field(default_factory=list)
    triton: list[dict[str, Any]] = field(default_factory=list)
    model: dict[str, Any] | None = None
    library_ops: dict[str, int] = field(default_factory=dict)  # namespace -> ops: context, not audited

    @property
    def failures(self) -> list[str]:
        out = [f"{op['name']}: {c['name']}" for op in self.ops for c in op["checks"] if c["status"] == "fail"]
        out += [f"{b['path']}: {b['check']['detail']}" for b in self.binaries if b["check"]["status"] == "fail"]
        if self.model and not self.model["exported"]:
            out.append(f"model {self.model['target']}: export failed")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"imports": self.imports, "device": self.device, "passed": not self.failures,
                "failures": self.failures, "ops": self.ops, "binaries": self.binaries,
                "triton_kernels": self.triton, "model": self.model, "library_ops": self.library_ops}


def _device() -> dict[str, Any]:
    import torch

    info = {"torch": torch.__version__, "torch_cuda_archs": torch.cuda.get_arch_list(), "cuda": False,
            "capability": None, "name": None}
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        info |= {"cuda": True, "capability": f"sm_{cap[0]}{cap[1]}", "name": torch.cuda.get_device_name()}
    return info


def _import_targets(names: list[str]) -> list[Path]:
    """Import the packages under audit: `names` come from `audit kernels --import PKG` (or the API's
    `imports`), code the user names on the command line to audit it, never a value read from a file."""
    dirs = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # any import-time error of the audited package is the user's to fix
            raise UserError(f"--import {name}: the package failed to import ({type(e).__name__}: {e}); "
                            "check that it is installed in this environment and on PYTHONPATH") from None
        file = getattr(mod, "__file__", None)
        if file:
            dirs.append(Path(file).parent if Path(file).name == "__init__.py" else Path(file))
    return dirs


def _binary_entry(binary, device: dict[str, Any]) -> dict[str, Any]:
    from torchcls.kernel_audit.binaries import runs_on

    d = binary.as_dict()
    if binary.error:
        d["check"] = {"status": "warn", "detail": binary.error, "fix": ""}
    elif not device["cuda"]:
        d["check"] = {"status": "skip", "detail": "no CUDA device here: targets listed, fit not checked",
                      "fix": "rerun on the target GPU machine"}
    else:
        cap = device["capability"].removeprefix("sm_")
        ok, why = runs_on(binary, (int(cap[:-1]), int(cap[-1])))
        d["check"] = {"status": "pass" if ok else "fail", "detail": why, "fix": "" if ok else why}
    return d


def audit_kernels(imports: list[str] = (), model: str | None = None,
                  namespaces: list[str] | None = None) -> KernelAudit:
    """Audit the custom ops registered after importing `imports` (and those a model's graph uses)."""
    import torch
    import torchvision  # noqa: F401  (torchcls's own dependency: its ops are there before the user's code runs)

    from torchcls.kernel_audit import binaries, graph, ops

    before = ops.namespaces_now()
    library = before - ops.BUILTIN_NAMESPACES
    dirs = [d for d in _import_targets(list(imports)) if d.is_dir()]
    audit = KernelAudit(list(imports), _device())
    model_info = None
    if model:
        net, x, kind = graph.load_audit_model(model)
        model_info = _split_library_ops({"target": model, "kind": kind} | graph.ops_in_graph(net, x), library)
    # Which ops to audit: the namespaces asked for, else those the imports and the model's code registered
    # (importing a package can also make PyTorch register its own lazy namespaces: those are not custom),
    # and in either case the custom ops the model's graph calls.
    scope = set(namespaces or ()) or (ops.namespaces_now() - before - ops.BUILTIN_NAMESPACES)
    if model_info:
        scope |= {name.split("::", 1)[0] for name in model_info["custom_ops"]}
    audit.ops = [ops.audit_op(n).as_dict() for n in ops.custom_op_names(scope)] if scope else []
    audit.library_ops = {ns: n for ns, n in ops.count_by_namespace(library).items() if ns not in scope}
    libs = [str(p) for p in getattr(torch.ops, "loaded_libraries", set())]
    for so in binaries.shared_objects(dirs, libs):
        found = binaries.scan_shared_object(so)
        if found is not None:
            audit.binaries.append(_binary_entry(found, audit.device))
    audit.triton = [k.as_dict() for k in binaries.triton_kernels(list(imports))]
    for k in audit.triton:  # Triton compiles at first call for the local GPU: no arch lock-in, but needs one
        k["check"] = {"status": "pass" if audit.device["cuda"] else "skip",
                      "detail": "JIT-compiled by Triton for the GPU it runs on" + (
                          "" if audit.device["cuda"] else "; no CUDA device here to compile it"),
                      "fix": ""}
    audit.model = model_info
    return audit


def _split_library_ops(model_info: dict[str, Any], library: set[str]) -> dict[str, Any]:
    """The graph's calls of library ops (torchvision::nms ...) apart from the user's custom ops."""
    calls = model_info["custom_ops"]
    model_info["library_ops"] = {k: v for k, v in calls.items() if k.split("::", 1)[0] in library}
    model_info["custom_ops"] = {k: v for k, v in calls.items() if k not in model_info["library_ops"]}
    return model_info


def default_out(model: str | None) -> Path:
    """Next to the run when auditing a run's checkpoint (so `torchcls report` finds it), else ./kernel-audit."""
    if model and Path(model).exists():
        from torchcls.checkpoint.files import resolve_checkpoint, run_dir_of

        run = run_dir_of(resolve_checkpoint(model))
        if run is not None:
            return run
    return Path("kernel-audit")


def write_audit(audit: KernelAudit, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "kernel_audit.json", json.dumps(audit.as_dict(), indent=2))
    write_text_atomic(out / "kernel_audit.md", to_markdown(audit.as_dict()))
    return out / "kernel_audit.json", out / "kernel_audit.md"


def to_markdown(d: dict[str, Any]) -> str:
    dev = d["device"]
    lines = [f"# Kernel audit: {'PASSED' if d['passed'] else 'FAILED'}", "",
             f"torch {dev['torch']}; local GPU: {dev['name'] or 'none'} ({dev['capability'] or 'no CUDA'}); "
             f"torch built for {', '.join(dev['torch_cuda_archs']) or 'CPU only'}", ""]
    if d["ops"]:
        lines += ["| op | keys | traceable | " + " | ".join(c["name"] for c in d["ops"][0]["checks"]) + " | status |",
                  "|" + "---|" * (4 + len(d["ops"][0]["checks"]))]
    for op in d["ops"]:
        lines.append(f"| {op['name']} | {' '.join(op['dispatch_keys'])} | {'yes' if op['traceable'] else 'no'} | "
                     + " | ".join(c["status"] for c in op["checks"]) + f" | {op['status']} |")
    if not d["ops"]:
        lines.append("(no custom ops registered by the imports or the model)")
    if d.get("library_ops"):
        lines += ["", library_line(d["library_ops"])]
    fixes = [(op["name"], c) for op in d["ops"] for c in op["checks"] if c["status"] in ("fail", "warn")]
    if fixes:
        lines += ["", "## What to fix", ""] + [f"- **{n}** {c['name']} ({c['status']}): {c['detail']} — {c['fix']}"
                                                for n, c in fixes]
    if d["binaries"]:
        lines += ["", "## Compiled GPU code", "", "| file | cubin | PTX | fit |", "|---|---|---|---|"]
        lines += [f"| {Path(b['path']).name} | {' '.join(b['sm'])} | {' '.join(b['ptx'])} | "
                  f"{b['check']['status']}: {b['check']['detail']} |" for b in d["binaries"]]
    if d["triton_kernels"]:
        lines += ["", "## Triton kernels", ""] + [f"- {k['module']}.{k['name']}: {k['check']['detail']}"
                                                 for k in d["triton_kernels"]]
    if d["model"]:
        m = d["model"]
        lines += ["", f"## Model {m['target']}", ""]
        lines.append(f"exported: {m['exported']}" + (f" ({m['error']})" if m["error"] else
                     f", {m['graph_calls']} calls; custom ops: " + (", ".join(f"{k} ×{v}" for k, v in
                                                                         m["custom_ops"].items()) or "none")))
        if m.get("library_ops"):
            lines.append("library ops it calls (context): " + ", ".join(f"{k} ×{v}" for k, v in m["library_ops"].items()))
    return "\n".join(lines) + "\n"


def library_line(library_ops: dict[str, int]) -> str:
    """The context line: library operators present but not audited, and how to audit them."""
    listing = ", ".join(f"{ns} ({n} ops)" for ns, n in sorted(library_ops.items()))
    first = sorted(library_ops)[0]
    return (f"Library operators, not audited (their maintainers test them): {listing}; "
            f"audit one with --namespace {first}")

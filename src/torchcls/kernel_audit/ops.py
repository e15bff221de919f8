"""Custom operators: which exist, which dispatch keys they have, and whether they pass opcheck."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torchcls.kernel_audit.examples import examples_for

# Namespaces that PyTorch itself defines (listed from `import torch` on 2.14): not "custom".
BUILTIN_NAMESPACES = frozenset({
    "aten", "prims", "quantized", "_quantized", "c10d", "_c10d_functional", "_c10d_functional_autograd",
    "_dtensor", "_native", "_test", "debug_mode_ops", "debugprims", "export", "inductor", "inductor_prims",
    "mkl", "mkldnn", "mkldnn_prepacked", "onednn", "profiler", "quantization", "rngprims", "sparse",
    "static_runtime", "symm_mem", "coor", "higher_order", "quantized_decomposed", "prepacked", "fbgemm",
    "streams", "_inductor_test", "onnx", "_quantized_decomposed", "aoti_torch", "_higher_order_ops",
    "c10d_functional", "flex_lib", "fsdp", "mempool", "onnx_symbolic",
})
DISPATCH_KEYS = ("CPU", "CUDA", "Meta", "Autograd", "AutogradCPU", "AutogradCUDA",
                 "CompositeExplicitAutograd", "CompositeImplicitAutograd")


@dataclass
class Check:
    name: str
    status: str  # pass | fail | warn | skip
    detail: str = ""
    fix: str = ""


@dataclass
class OpReport:
    name: str
    schema: str
    dispatch_keys: list[str]
    traceable: bool
    examples: str
    checks: list[Check] = field(default_factory=list)

    @property
    def status(self) -> str:
        states = {c.status for c in self.checks}
        return "fail" if "fail" in states else "warn" if "warn" in states else "pass"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"status": self.status}


def namespaces_now() -> set[str]:
    return {n.split("::", 1)[0] for n in torch._C._dispatch_get_all_op_names() if "::" in n}


def custom_op_names(namespaces: set[str] | None = None) -> list[str]:
    """Ops outside PyTorch's own namespaces (or exactly those in `namespaces`)."""
    names = torch._C._dispatch_get_all_op_names()
    keep = (lambda ns: ns in namespaces) if namespaces else (lambda ns: ns not in BUILTIN_NAMESPACES)
    return sorted(n for n in names if "::" in n and keep(n.split("::", 1)[0]))


def count_by_namespace(namespaces: set[str]) -> dict[str, int]:
    """How many ops each of `namespaces` holds (overloads counted once per op)."""
    counts: dict[str, int] = {}
    for n in {n.split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names() if "::" in n}:
        ns = n.split("::", 1)[0]
        if ns in namespaces:
            counts[ns] = counts.get(ns, 0) + 1
    return dict(sorted(counts.items()))


def _has(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def _fake_impl(name: str) -> bool:
    from torch._library.simple_registry import singleton

    entry = singleton.find(name)
    return entry.fake_impl.kernel is not None or _has(name, "Meta") or _has(name, "CompositeImplicitAutograd")


def _autograd(name: str) -> bool:
    from torch._library.custom_ops import OPDEFS

    if name in OPDEFS:  # custom_op always installs an Autograd kernel; it only works with a backward
        return OPDEFS[name]._backward_fn is not None
    return any(_has(name, k) for k in ("Autograd", "AutogradCPU", "AutogradCUDA", "CompositeImplicitAutograd"))


def _overload(name: str):
    ns, rest = name.split("::", 1)
    op, _, overload = rest.partition(".")  # all-op-names lists "ns::op" and "ns::op.overload"
    return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")


def audit_op(name: str) -> OpReport:
    keys = [k for k in DISPATCH_KEYS if _has(name, k)]
    overload = _overload(name)
    composite = any(k.startswith("Composite") for k in keys)
    fake = _fake_impl(name)
    makers, origin = examples_for(name)
    report = OpReport(name, str(overload._schema), keys, fake, origin)
    add = report.checks.append
    add(Check("cpu_kernel", "pass" if "CPU" in keys or composite else "warn",
              "CPU or composite kernel registered" if "CPU" in keys or composite else "no CPU kernel",
              "" if "CPU" in keys or composite else "register a CPU kernel (torch.library.register_kernel(op, 'cpu'))"))
    add(Check("cuda_kernel", "pass" if "CUDA" in keys or composite else "warn",
              "CUDA or composite kernel registered" if "CUDA" in keys or composite else "no CUDA kernel",
              "" if "CUDA" in keys or composite else "register a CUDA kernel or the op runs on CPU only"))
    add(Check("fake_impl", "pass" if fake else "fail",
              "fake/meta impl: torch.compile and torch.export can trace it" if fake
              else "no fake impl: torch.compile graph-breaks and torch.export fails on this op",
              "" if fake else "add @torch.library.register_fake(op) returning empty outputs of the right shape"))
    grad = _autograd(name)
    add(Check("autograd", "pass" if grad else "warn", "backward registered" if grad else "no backward formula",
              "" if grad else "torch.library.register_autograd(op, backward, setup_context=...) if it is trained"))
    add(_opcheck(overload, makers, origin))
    if report.checks[-1].status == "fail" and "test_faketensor" in report.checks[-1].detail:
        report.traceable = False  # a fake impl exists but lies about shapes: traces would be wrong
    return report


def _opcheck(overload, makers, origin: str) -> Check:
    if not makers:
        return Check("opcheck", "skip", "no sample inputs",
                     "register one with torchcls.audit.register_example or TORCHCLS_OP_EXAMPLES")
    for i, make in enumerate(makers):
        try:
            args, kwargs = make()
            results = torch.library.opcheck(overload, args, kwargs)
        except Exception as e:  # OpCheckError, or the op itself rejected the sample
            first = str(e).split(" (scroll up")[0][:500]
            if type(e).__name__ != "OpCheckError":  # (its class lives in torch.testing._internal: named, not imported)
                first = f"raised {type(e).__name__}: {first}"
            if origin == "generated from schema":  # a made-up sample may simply be invalid for the op
                return Check("opcheck", "warn", f"generated sample: {first}",
                             "register a valid example (torchcls.audit.register_example) for a real check")
            return Check("opcheck", "fail", f"sample {i} ({origin}): {first}", _opcheck_fix(first))
    return Check("opcheck", "pass", f"{len(makers)} sample(s) ({origin}): " + ", ".join(f"{k} ok" for k in results))


def _opcheck_fix(message: str) -> str:
    for test, fix in (("test_faketensor", "the fake impl must return outputs with the same shape/dtype/strides "
                       "as the real kernel"),
                      ("test_schema", "the schema's mutates_args/aliasing does not match what the kernel does"),
                      ("test_autograd_registration", "register backward with torch.library.register_autograd"),
                      ("test_aot_dispatch", "the op fails under AOTAutograd: check fake impl and backward")):
        if test in message:
            return fix
    return "see the opcheck message"

"""Audits: custom operators and GPU kernels (`torchcls audit kernels`)."""

from torchcls.audit.examples import register_example

__all__ = ["register_example", "audit_kernels"]


def audit_kernels(*args, **kwargs):
    from torchcls.audit.kernels import audit_kernels as run

    return run(*args, **kwargs)

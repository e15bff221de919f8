"""The kernel audit: custom operators and GPU kernels (`torchcls audit kernels`; public names also at `torchcls.audit`)."""

from torchcls.kernel_audit.examples import register_example

__all__ = ["register_example", "audit_kernels"]


def audit_kernels(*args, **kwargs):
    from torchcls.kernel_audit.kernels import audit_kernels as run

    return run(*args, **kwargs)

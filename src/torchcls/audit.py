"""`torchcls audit`'s public Python names, at the path the docs give op authors
(`from torchcls.audit import register_example`): the kernel audit itself is `torchcls.kernel_audit`,
named apart from governance's audit log."""

from torchcls.kernel_audit import audit_kernels, register_example

__all__ = ["audit_kernels", "register_example"]

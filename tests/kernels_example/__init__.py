"""A small custom-op package for `torchcls audit kernels`: one correct op, one with a broken fake impl.

Both ops have a CPU kernel (composite, via torch.library.custom_op) and a backward. The
broken one's fake impl returns the input's shape although the kernel reduces the last
dim, which torch.compile/torch.export would silently trace wrong: opcheck catches it.
There is also a Triton kernel (defined, never launched: this machine has no GPU) so the
audit's Triton scan has something real to find.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels_example import triton_kernels  # noqa: F401  (registers nothing; defines @triton.jit kernels)

NAMESPACE = "torchcls_example"


@torch.library.custom_op(f"{NAMESPACE}::scaled_gelu", mutates_args=())
def scaled_gelu(x: Tensor, scale: float) -> Tensor:
    return torch.nn.functional.gelu(x) * scale


@scaled_gelu.register_fake
def _(x: Tensor, scale: float) -> Tensor:
    return torch.empty_like(x)


def _gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _gelu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        xd = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(torch.nn.functional.gelu(xd), xd, grad * ctx.scale)
    return g, None


scaled_gelu.register_autograd(_gelu_backward, setup_context=_gelu_setup)


@torch.library.custom_op(f"{NAMESPACE}::row_sum", mutates_args=())
def row_sum(x: Tensor) -> Tensor:
    return x.sum(dim=-1)


@row_sum.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)  # BUG (on purpose): the real kernel drops the last dim


def _sum_setup(ctx, inputs, output):
    ctx.shape = inputs[0].shape


row_sum.register_autograd(lambda ctx, grad: grad.unsqueeze(-1).expand(ctx.shape), setup_context=_sum_setup)

# Sample inputs for opcheck, declared without importing torchcls.
TORCHCLS_OP_EXAMPLES = {
    f"{NAMESPACE}::scaled_gelu": [lambda: ((torch.randn(4, 8, requires_grad=True), 0.5), {}),
                                  lambda: ((torch.randn(2, 3, 5), 2.0), {})],
    f"{NAMESPACE}::row_sum": lambda: ((torch.randn(4, 8, requires_grad=True),), {}),
}


class GeluNet(nn.Module):
    """A tiny classifier whose activation is the custom op: its exported graph calls it twice."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.ops.torchcls_example.scaled_gelu(self.conv(x), 1.0).mean(dim=(2, 3))
        return self.fc2(torch.ops.torchcls_example.scaled_gelu(self.fc1(x), 1.0))


def gelu_net() -> tuple[nn.Module, Tensor]:
    """Factory for `torchcls audit kernels --model kernels_example:gelu_net`."""
    return GeluNet(), torch.randn(2, 3, 16, 16)

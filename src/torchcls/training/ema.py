"""An exponential moving average (EMA) of the weights, for one process, DDP and FSDP2 alike.

    ema = WeightEma(model, decay=0.999)
    ema.update(model, step)                 # after each optimizer step
    with ema.swapped_in(model):             # validate / save the averaged weights
        validate(model, ...)

timm's ModelEmaV3 and torch's AveragedModel keep the average in a deep copy of the model, and an
FSDP2 module cannot be deep-copied. The average here is one tensor per parameter and floating-point
buffer, cloned from the model's own (so under FSDP2 they are DTensors sharded like the parameters,
and DCP saves and reshards them like the rest of the training state); it is used by copying it into
the model's tensors in place and back, so compiled graphs and parallel wrappers see the same tensors.
The update is timm's (`ema = lerp(ema, weights, 1 - decay)`, foreach), with the usual warm-up
`decay_t = min(decay, (1 + t) / (10 + t))` so that a short run is not dominated by its random init.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def _tracked(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the average follows: parameters and floating-point buffers (BatchNorm statistics);
    integer buffers (num_batches_tracked) are not averaged."""
    model = getattr(model, "_orig_mod", model)
    tensors = dict(model.named_parameters())
    tensors |= {k: b for k, b in model.named_buffers() if b.is_floating_point()}
    return tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (a view: writing it writes the parameter), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class WeightEma:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            from torchcls.errors import UserError

            raise UserError(f"--ema {decay}: give a decay in (0, 1), e.g. 0.999 (0 turns EMA off)")
        self.decay = decay
        self.names = list(_tracked(model))
        self.shadow = [t.detach().clone() for t in _tracked(model).values()]

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        current = [_local(t.detach()) for t in _tracked(model).values()]
        torch._foreach_lerp_([_local(t) for t in self.shadow], current, 1.0 - self.decay_at(step))

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own again after it."""
        tensors = [_local(t.detach()) for t in _tracked(model).values()]
        own = [t.clone() for t in tensors]
        torch._foreach_copy_(tensors, [_local(t) for t in self.shadow])
        try:
            yield
        finally:
            torch._foreach_copy_(tensors, own)

    # The checkpointer saves and restores these (in place under DCP).
    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in zip(self.names, self.shadow):
            if state[name] is not t:
                t.copy_(state[name])

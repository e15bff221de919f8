"""torchcls.suite.timed_steps: the timed training steps the precision benchmarks share. No scalar is read back
inside the timed steps (Tensor.item raises there), the losses match an ordinary loop that checks every
step, and a non-finite step is still caught, once, after the timing."""

import pytest
import torch
from torch import nn

from torchcls.config import PrecisionConfig
from torchcls.precision.training import NonFiniteLoss, apply_precision
from torchcls.suite.timed_steps import fused_adamw, timed_train_steps

CPU = torch.device("cpu")


def model_and_batches(poison: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 4, 4, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]
    if poison:
        batches[1][0][0, 0, 0, 0] = float("nan")
    return model, batches


def reference_losses(steps: int) -> list[float]:
    """The same steps with the per-step check (a host read each step), losses read as they come."""
    model, batches = model_and_batches()
    plan = apply_precision(model, PrecisionConfig(precision="fp32"), CPU)
    opt = fused_adamw(model, 1e-2)
    out = []
    for i in range(steps):
        x, y = batches[i % 2]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        assert plan.backward_step(loss, opt, model, 1.0, i + 1) is True
        out.append(loss.item())
    return out


def test_no_scalar_is_read_inside_the_timed_steps_and_losses_match_a_checked_loop(monkeypatch):
    model, batches = model_and_batches()
    plan = apply_precision(model, PrecisionConfig(precision="fp32"), CPU)

    def refuse(self):
        raise AssertionError("Tensor.item() inside the timed steps: a host synchronisation per step on a GPU")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    result = timed_train_steps(model, plan, fused_adamw(model, 1e-2), batches, warmup=2, steps=5)
    monkeypatch.undo()
    assert result["deferred_nonfinite_check"] is True and result["timed_steps"] == 5
    assert result["step_ms"] > 0 and result["images_per_s"] > 0 and result["host_syncs_in_timed_steps"] is None
    assert result["losses"] == pytest.approx(reference_losses(8), abs=1e-5)
    assert result["losses"][-1] < result["losses"][0]


def test_a_non_finite_step_is_reported_after_the_timing_not_hidden():
    model, batches = model_and_batches(poison=True)
    plan = apply_precision(model, PrecisionConfig(precision="fp32"), CPU)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLoss, match="non-finite loss or gradient norm"):
        timed_train_steps(model, plan, fused_adamw(model, 1e-2), batches, warmup=0, steps=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the poisoned step was not applied
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the clean one was

"""Early-exit models: autograd through the branches, eager vs torch.cond, calibration, bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch

from torchcls.errors import UserError
from torchcls.models import ModelSpec, SmallNet, create_model
from torchcls.models.early_exit import CondEarlyExit, EarlyExitNet, build_early_exit, confidence, exit_loss


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one thread avoids OpenMP spin-waits under load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(threshold: float = 0.5, width: int = 2, dtype=torch.float32) -> EarlyExitNet:
    torch.manual_seed(0)
    return build_early_exit("smallnet", SmallNet(3, 1, width=width), 3, 0, threshold).to(dtype).eval()


def split_threshold(model: EarlyExitNet, x: torch.Tensor) -> float:
    """A threshold that sends some samples out at exit 0 and the others further."""
    with torch.no_grad():
        conf = confidence(model.all_exits(x)[0]).sort().values
    return float((conf[len(conf) // 2 - 1] + conf[len(conf) // 2]) / 2)


def test_gradcheck_double_precision_both_branches():
    model = tiny(width=2, dtype=torch.float64)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64, requires_grad=True)
    for threshold in (0.0, 1.0):  # everyone leaves at exit 0 / everyone runs to the last exit
        model.threshold = threshold
        assert torch.autograd.gradcheck(lambda inp: model.dynamic(inp)[0], (x,), eps=1e-6, atol=1e-5)
    y = torch.tensor([0, 2])  # the training objective (BN frozen): weighted loss over all exits
    assert torch.autograd.gradcheck(
        lambda inp: exit_loss(torch.nn.functional.cross_entropy, model.all_exits(inp), y, model)[0], (x,),
        eps=1e-6, atol=1e-5)


def _grads(module: torch.nn.Module) -> float:
    return sum(float(p.grad.abs().sum()) for p in module.parameters() if p.grad is not None)


def test_gradients_reach_only_the_branch_taken():
    model = tiny(width=4)
    x = torch.randn(16, 1, 12, 12)
    model.threshold = split_threshold(model, x)
    _, index = model.dynamic(x)
    early, late = (index == 0).nonzero()[0].item(), (index > 0).nonzero()[0].item()
    for sample, used_depth in ((early, 0), (late, int(index[late]))):
        model.zero_grad(set_to_none=True)
        model.dynamic(x)[0][sample].sum().backward()
        for k in range(model.num_exits):
            seg, head = _grads(model.segments[k]), _grads(model.heads[k])
            assert (seg > 0) == (k <= used_depth), (sample, k)
            assert (head > 0) == (k == used_depth), (sample, k)  # earlier heads only decided, no gradient


def test_training_returns_every_exit_and_weights_the_loss():
    model = tiny(width=4).train()
    x, y = torch.randn(8, 1, 12, 12), torch.randint(0, 3, (8,))
    outs = model(x)
    assert isinstance(outs, tuple) and len(outs) == 3 and all(o.shape == (8, 3) for o in outs)
    ce = torch.nn.CrossEntropyLoss()
    loss, final = exit_loss(ce, outs, y, model)
    expected = sum(w * ce(o, y) for w, o in zip(model.loss_weights, outs))
    assert torch.allclose(loss, expected) and final is outs[-1]
    assert model.loss_weights[0] < model.loss_weights[-1] and abs(sum(model.loss_weights) - 1) < 1e-9
    loss.backward()
    assert all(_grads(h) > 0 for h in model.heads) and all(_grads(s) > 0 for s in model.segments)
    plain = torch.randn(8, 3, requires_grad=True)  # a plain model's logits pass through unchanged
    assert torch.allclose(exit_loss(ce, plain, y)[0], ce(plain, y))


@pytest.mark.parametrize("mode", ["all-early", "all-late", "mixed"])
def test_eager_if_and_torch_cond_give_identical_predictions(mode):
    model = tiny(width=4)
    x = torch.randn(16, 1, 12, 12)
    model.threshold = {"all-early": 0.0, "all-late": 1.0, "mixed": split_threshold(model, x)}[mode]
    with torch.no_grad():
        eager, eager_index = model.dynamic(x)
        cond, cond_index = CondEarlyExit(model)(x)
    assert torch.equal(eager.argmax(1), cond.argmax(1))
    assert torch.equal(eager_index, cond_index.long())
    assert torch.allclose(eager, cond, atol=1e-5)
    expected = {"all-early": {0}, "all-late": {2}, "mixed": None}[mode]
    if expected is not None:
        assert set(eager_index.tolist()) == expected
    else:
        assert 0 in eager_index.tolist() and any(i > 0 for i in eager_index.tolist())


def test_registry_names_backbones_and_old_specs():
    ee = create_model(ModelSpec("ee/smallnet", 10, 1, 28, exits=1, exit_threshold=0.7))
    assert isinstance(ee, EarlyExitNet) and ee.num_exits == 2 and ee.threshold == 0.7
    resnet = create_model(ModelSpec("ee/resnet18", 5, 3, 32))
    assert resnet.num_exits == 4
    with torch.no_grad():
        assert resnet.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 5)
    old = ModelSpec(**{"name": "smallnet", "num_classes": 3, "in_chans": 1, "img_size": 28, "drop_rate": 0.0})
    assert isinstance(create_model(old), SmallNet)  # checkpoints written before early exits still load


THRESHOLD_RANGE = "exit_threshold (--exit-threshold) must be a number in [0.0, 1.0]"


@pytest.mark.parametrize("spec, message", [
    (ModelSpec("ee/smallnet", 3, 1, 28, exit_threshold=1.5), THRESHOLD_RANGE),
    (ModelSpec("ee/smallnet", 3, 1, 28, exit_threshold=-0.1), THRESHOLD_RANGE),
    (ModelSpec("ee/smallnet", 3, 1, 28, exits=3), "offers 1 to 2 intermediate exits"),
    (ModelSpec("ee/resnet18", 3, 3, 32, exits=4), "offers 1 to 3 intermediate exits"),
    (ModelSpec("ee/tv/mobilenet_v3_small", 3, 3, 32), "no early-exit support"),
    (ModelSpec("ee/vit_tiny_patch16_224", 3, 3, 32), "no early-exit support"),
    (ModelSpec("smallnet", 3, 1, 28, exits=1), "needs an early-exit model name"),
])
def test_bad_early_exit_specs_are_user_errors(spec, message):
    with pytest.raises(UserError, match=re.escape(message)):
        create_model(spec)


def test_cli_rejects_bad_threshold(tmp_path, capsys):
    from torchcls.cli import main

    code = main(["train", "--model", "ee/smallnet", "--exit-threshold", "2", "--epochs", "1",
                 "--out-dir", str(tmp_path), "--no-progress", "--workers", "0"])
    assert code == 2
    assert "[model] exit_threshold = 2.0 is outside the allowed range [0, 1]" in capsys.readouterr().err


def test_calibration_hits_its_target_on_a_fixed_data_set():
    from torchcls.evaluation.exit_sweep import ExitCosts, calibrate, reached, simulate, sweep

    g = torch.Generator().manual_seed(0)
    n, c = 400, 4
    targets = torch.randint(0, c, (n,), generator=g)
    # Three exits, each more often right; confidence grows with correctness, as in a trained net.
    logits = torch.randn(3, n, c, generator=g)
    for k, p_right in enumerate((0.6, 0.75, 0.9)):
        right = torch.rand(n, generator=g) < p_right
        logits[k, torch.arange(n)[right], targets[right]] += 3.0 + k
    costs = ExitCosts([4.0, 7.0, 10.0], 9.5)
    points = sweep(logits, targets, costs)
    for target in (0.7, 0.8, 0.85):
        chosen = calibrate(points, target_accuracy=target)
        assert chosen.accuracy >= target
        assert chosen.mean_flops == min(p.mean_flops for p in points if p.accuracy >= target)
    for budget in (0.6, 0.8):
        chosen = calibrate(points, target_compute=budget)
        assert chosen.relative_compute <= budget
        assert chosen.accuracy == max(p.accuracy for p in points if p.relative_compute <= budget)
    index = simulate(logits, 0.9)  # the replayed rule: the first confident exit, else the last
    conf = logits.softmax(2).amax(2)
    assert all((conf[:int(i), s] < 0.9).all() and (int(i) == 2 or conf[int(i), s] >= 0.9)
               for s, i in enumerate(index))
    # A target no threshold meets: the nearest one (the most accurate; the cheapest), not an error.
    best = calibrate(points, target_accuracy=0.999)
    assert best.accuracy == max(p.accuracy for p in points) and not reached(best, 0.999, None)
    cheapest = calibrate(points, target_compute=0.01)
    assert cheapest.relative_compute == min(p.relative_compute for p in points) and not reached(cheapest, None, 0.01)
    with pytest.raises(UserError, match="outside"):
        calibrate(points, target_accuracy=1.5)
    with pytest.raises(UserError, match="exactly one"):
        calibrate(points)


def test_graph_break_report_counts_breaks_and_reasons(tmp_path):
    from torchcls.training.graph_breaks import explain_graph_breaks, report_graph_breaks

    model = tiny(width=4)
    x = torch.randn(4, 1, 12, 12)
    model.threshold = split_threshold(model, x)
    eager = explain_graph_breaks(model, x)  # data-dependent Python branching: breaks, with reasons
    assert eager.graph_breaks >= 1 and eager.graphs == eager.graph_breaks + 1 and eager.reasons
    assert explain_graph_breaks(CondEarlyExit(model), x).graph_breaks == 0  # torch.cond: one graph
    model.train()
    stats = {k: v.clone() for k, v in model.named_buffers()}
    dataset = [(x[i], 0) for i in range(4)]
    report = report_graph_breaks(model, dataset, tmp_path, torch.device("cpu"), torch.contiguous_format)
    assert report.graph_breaks == 0 and report.graphs == 1
    assert json.loads((tmp_path / "graph_breaks.json").read_text())["graph_breaks"] == 0
    assert all(torch.equal(v, stats[k]) for k, v in model.named_buffers())  # BN stats untouched

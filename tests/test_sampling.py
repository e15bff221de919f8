"""--balanced-sampler: the epoch's draws follow 1 / class frequency, in both feeds, and resume exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_image_folder, tiny_config


def test_balanced_weights_draw_every_class_about_equally() -> None:
    from torchcls.data.sampling import EpochSampler, balanced_weights, epoch_order

    targets = torch.tensor([0] * 540 + [1] * 60)  # 9 : 1
    sampler = EpochSampler(len(targets), seed=3, shuffle=True)
    plain = torch.tensor([targets[i] for i, _ in sampler])
    sampler.weights = balanced_weights(targets, ["many", "few"])
    drawn = torch.tensor([targets[i] for i, _ in sampler])
    assert len(drawn) == len(targets)  # an epoch is still as long as the training set
    assert plain.float().mean() == pytest.approx(0.1)
    assert 0.4 < drawn.float().mean() < 0.6
    # one order for the map-style sampler and the in-memory loader; another epoch draws another
    order = epoch_order(len(targets), 3, 0, sampler.weights)[0].tolist()
    assert [i for i, _ in sampler] == order
    assert epoch_order(len(targets), 3, 1, sampler.weights)[0].tolist() != order


def test_balanced_weights_refuse_multilabel_targets() -> None:
    from torchcls.data.sampling import balanced_weights
    from torchcls.errors import UserError

    with pytest.raises(UserError, match="--balanced-sampler .* multilabel"):
        balanced_weights(torch.zeros(4, 3), ["a", "b", "c"])


@pytest.mark.parametrize("in_memory", ["on", "off"])
def test_a_balanced_run_trains_on_an_imbalanced_folder(tmp_path: Path, in_memory: str) -> None:
    from torchcls.training import train

    source = make_image_folder(tmp_path / "shapes", per_class=4)
    make_image_folder(source, per_class=30, classes=("circle",))  # circle 30 : square 4
    cfg = tiny_config(source, tmp_path, "balanced", epochs=1)
    cfg.data.balanced_sampler, cfg.data.in_memory, cfg.governance.lineage = True, in_memory, False
    result = train(cfg)
    assert result.steps == 4  # 27 training images in batches of 8

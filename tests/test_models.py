import pytest
import torch

from torchcls.errors import UserError
from torchcls.models import ModelSpec, create_model


@pytest.mark.parametrize("name, chans, size", [
    ("smallnet", 1, 28), ("resnet18", 1, 28), ("vit_tiny_patch16_224", 3, 32), ("tv/resnet18", 1, 32),
    ("tv/mobilenet_v3_small", 3, 32),
])
def test_models_adapt_classes_and_channels(name, chans, size):
    model = create_model(ModelSpec(name, num_classes=7, in_chans=chans, img_size=size)).eval()
    with torch.no_grad():
        out = model(torch.randn(2, chans, size, size))
    assert out.shape == (2, 7)


def test_unknown_model_suggests_names():
    with pytest.raises(UserError, match="Did you mean: .*resnet18"):
        create_model(ModelSpec("resnet81", 10, 3, 32))
    with pytest.raises(UserError, match="unknown model 'tv/resnet1000'"):
        create_model(ModelSpec("tv/resnet1000", 10, 3, 32))

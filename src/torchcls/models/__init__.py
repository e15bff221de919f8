"""Models: a registry behind one name string, and the built-in SmallNet."""

from torchcls.models.registry import ModelSpec, create_model
from torchcls.models.smallnet import SmallNet

__all__ = ["ModelSpec", "SmallNet", "create_model"]

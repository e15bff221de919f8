"""Training: the loop, precision, parallelism and checkpoints, each applied from outside the model."""

from torchcls.training.loop import TrainResult, train

__all__ = ["TrainResult", "train"]

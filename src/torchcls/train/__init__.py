"""Training: the loop, precision, parallelism and checkpoints, each applied from outside the model."""

from torchcls.train.loop import TrainResult, train

__all__ = ["TrainResult", "train"]

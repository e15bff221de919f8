"""Evaluation: metrics and calibration of a checkpoint or artifact on labelled data, early-exit statistics."""

from torchcls.evaluation.evaluator import evaluate

__all__ = ["evaluate"]

"""Precision applied from outside model code: FP8 capability checks, the per-layer FP8
eligibility rule shared by training and inference, and inference quantization with parity.

Training precision (autocast, grad scaler, FP8 training, NaN/Inf guard) lives in
torchcls.precision.training; inference precision in torchcls.precision.inference.
"""

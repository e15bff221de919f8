"""Precision, applied from outside model code; one home for it.

- dtypes.py: DTYPES, the one table from precision names (fp32, bf16, fp16) to torch dtypes.
- training.py: the training plan from a PrecisionConfig: autocast, gradient scaler (fp16), NaN/Inf guard,
  FP8 conversion, precision.json. It does not decide whether to compile (torchcls.training does);
  `fp8_wants_compile` says what FP8 asks for.
- fp8.py: FP8 training through torchao or TransformerEngine (conversion, FSDP2 FP8 all-gather checks).
- fp8_layers.py: which Linear layers FP8 converts and why the others are not (pure rule, no torchao).
- hardware.py: what this device can do (bf16, fp16, FP8 tensor cores, torchao installed), errors naming the fix.
- inference.py: CastIO, the one bf16/fp16 inference wrapper, and apply_inference_precision (bf16, int8, fp8).
- report.py: the precision headline and FP8 layer table for the console and report.html.

Parity against fp32 is torchcls.artifacts.parity.compare; quantize-then-check-parity is
torchcls.artifacts.quantize.quantize_for_inference. Nothing here imports torchcls.artifacts.
"""

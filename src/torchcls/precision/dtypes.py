"""The one table from precision names to torch dtypes, shared by training, inference, compile and export.

fp8 is not a dtype here: FP8 training autocasts to bf16 around float8 matmuls (see precision.training),
and fp8/int8 inference are torchao quantizations of a model (see precision.inference).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

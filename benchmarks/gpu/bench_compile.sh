#!/usr/bin/env bash
# torch.compile gains of 3 backbones on one H100/H200: eager vs compiled (Inductor, freezing),
# batch 1 and 32, bf16 autocast, each configuration in its own process with a fresh cache.
# Budget: < 8 minutes (6 configurations; cold compile ~20-50 s each on such a GPU host).
# Not runnable on the project's CPU machines (no GPU): it stops with a message there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
OUT=${OUT:-bench-gpu}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "bench_compile.sh needs a CUDA GPU (H100/H200); none is visible here." >&2
  exit 3
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
time "$PY" -m torchcls bench compile \
  --models resnet50,convnext_tiny,vit_small_patch16_224 \
  --batch 1,32 --precision bf16 --modes default \
  --device cuda --repeats 30 --timeout 240 --out "$OUT"
echo "results: $OUT/bench_compile.md, $OUT/bench_compile.json, $OUT/bench_compile.png"

#!/usr/bin/env bash
# FSDP2 / DDP per-rank memory on the GPUs of one host (NCCL): ViT-Large, world sizes 1, 2, 4, 8
# up to the number of GPUs, CUDA allocator peaks next to the analytic model, and the fit for a
# mixed cluster (141 GiB H200s with 80 GiB H100s, alternating). Budget: < 8 minutes.
# Not runnable on the project's CPU machines (no GPU): it stops with a message there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
OUT=${OUT:-bench-gpu-memory}
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
  echo "bench_memory.sh needs CUDA GPUs; none is visible here." >&2
  exit 3
fi
WORLDS=$(for w in 1 2 4 8; do [ "$w" -le "$GPUS" ] && printf '%s,' "$w"; done | sed 's/,$//')
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
time "$PY" -m torchcls bench memory --model vit_large_patch16_224 --parallel ddp,fsdp2 \
  --world-sizes "$WORLDS" --batch 16 --steps 3 --timeout 240 \
  --device-memory 141GiB,80GiB,141GiB,80GiB,141GiB,80GiB,141GiB,80GiB --out "$OUT"
echo "results: $OUT/bench_memory.md, $OUT/bench_memory.json, $OUT/bench_memory.png"

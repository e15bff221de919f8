#!/usr/bin/env bash
# The one device check of torchcls (issue 18): every CUDA path on one GPU in <= 540 s of wall time, one
# JSON (check.json) and one Markdown table (check.md) with pass/fail and figures. See check.py.
#
#   bash benchmarks/gpu/check.sh --dry-run          # steps and budgets as one JSON object (runs anywhere)
#   bash benchmarks/gpu/check.sh --out gpu-check    # on a GPU machine
#   bash benchmarks/gpu/check.sh --only env,export_aoti_cuda,inference_bench   # a subset (dependencies too)
#
# It runs from the project's own .venv (PY=... overrides). Without one it builds it with `make` from local
# files only (pip --no-index: a wheelhouse named by PIP_FIND_LINKS), never from the web; if that is not
# possible it stops and says so.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
dry_run=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry_run=1; done
if [ ! -x "$PY" ]; then
  if [ "$dry_run" = 1 ]; then
    PY=$(command -v python3)  # the dry run imports nothing beyond the standard library
  else
    echo "check.sh: no $PY; building .venv with make from local files (pip --no-index)" >&2
    if ! PIP_NO_INDEX=1 make .venv/.installed-test >&2; then
      echo "check.sh: .venv could not be built from local files. Build it first (make test, or copy the project's" \
           ".venv), or set PY=/path/to/python of an environment with torch (CUDA), timm, torchao and torchcls" >&2
      exit 2
    fi
  fi
fi
exec "$PY" benchmarks/gpu/check.py "$@"

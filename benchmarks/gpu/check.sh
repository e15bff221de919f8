#!/usr/bin/env bash
# The one device check of torchcls (issues 18, 25): every CUDA path on one GPU, in parts that each fit one call
# (part 1: 8 minutes, what matters most), one JSON (check.json) and one Markdown table (check.md) with
# pass/fail and figures. See check.py and check_steps.py.
#
#   bash benchmarks/gpu/check.sh --dry-run                          # steps, parts and budgets as one JSON object
#   bash benchmarks/gpu/check.sh --part 1 --out gpu-check --collect "$OUT"   # on a GPU machine
#   bash benchmarks/gpu/check.sh --only preflight,aoti_smoke        # a subset (and the steps it needs)
#   PY=python3 bash benchmarks/gpu/check.sh --part 1                # a bare name is looked up on PATH
#   PY=/work/t211venv/bin/python bash benchmarks/gpu/check.sh --part 1 --rehearse --out r   # CPU stand-ins
#
# It runs from the project's own .venv (PY=... overrides). Without one it builds it with `make` from local
# files only (pip --no-index: a wheelhouse named by PIP_FIND_LINKS), never from the web; failing that, as a
# venv over the machine's own site-packages (a preinstalled CUDA torch) with torchcls from this checkout.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
# A bare name (PY=python3) is looked up on PATH, as the shell would run it.
case "$PY" in */*) ;; *) PY=$(command -v "$PY" || echo "$PY") ;; esac
dry_run=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry_run=1; done
if [ ! -x "$PY" ]; then
  if [ "$dry_run" = 1 ]; then
    PY=$(command -v python3)  # the dry run imports nothing beyond the standard library
  elif [ "$PY" != .venv/bin/python ]; then
    echo "check.sh: PY=$PY is not an executable" >&2
    exit 2
  else
    echo "check.sh: no .venv; building it with make from local files only (pip --no-index)" >&2
    if ! PIP_NO_INDEX=1 make .venv/.installed-test >&2; then
      # No local wheelhouse: a venv over the machine's own packages (its CUDA torch) plus this checkout's
      # torchcls, nothing downloaded. The env step records which torch that is.
      echo "check.sh: make could not install from local files; using the system's packages in .venv" >&2
      rm -rf .venv  # made by the failed make above (there was none before)
      python3 -m venv --system-site-packages .venv >&2 &&
        { .venv/bin/pip install -q --no-index --no-deps --no-build-isolation -e . >&2 ||
          echo "check.sh: torchcls not installed into .venv; it runs from src/ (PYTHONPATH)" >&2; }
    fi
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
      echo "check.sh: no usable .venv (torch missing). Build it first (make test), or set PY=/path/to/python of an" \
           "environment with torch (CUDA), timm, torchao and torchcls's dependencies" >&2
      exit 2
    fi
  fi
fi
exec "$PY" benchmarks/gpu/check.py "$@"

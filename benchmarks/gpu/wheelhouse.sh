#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu/wheels.txt into .whl/ for the device machine (Python 3.12, x86-64,
# manylinux), with no dependencies resolved (the list names each one), and keep .whl/ out of git. Then:
#   run(carry=[".whl"], command="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#       --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
#       PY=python3 bash benchmarks/gpu/check.sh --part 1 --out /tmp/gpu-check --collect $OUT")
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")" .whl
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
platforms=()
for n in 28 27 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mapfile -t wheels < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' benchmarks/gpu/wheels.txt | grep .)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${wheels[@]}"
ls .whl | wc -l | xargs echo "wheels:"
du -sh .whl

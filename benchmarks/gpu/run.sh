#!/usr/bin/env bash
# On a lent GPU machine, from the repository root: unpack .gpu/ (python -m benchmarks.gpu.bundle)
# once per machine, then run the command with it, e.g.
#   bash benchmarks/gpu/run.sh python3 -m torchrec_neuroshard.lab.measure_uvm --out "$OUT"
# A whole lent session, prepared and dry-run tested: python3 benchmarks/gpu/session.py --budget-s 540 --out "$OUT"
set -euo pipefail
SITE=/tmp/neuroshard-site
if [ ! -d "$SITE/fbgemm_gpu" ]; then
    mkdir -p "$SITE"
    xz -dc .gpu/fbgemm_sm90.tar.xz | tar xf - -C "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/*.whl
fi
export PYTHONPATH="$SITE:$PWD" CUDA_MODULE_LOADING=LAZY PYTHONUNBUFFERED=1
exec "$@"

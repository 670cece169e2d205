#!/usr/bin/env bash
# session 21, GPU call 6: cold start of the prebuilt hopper package whose K = 64 bf16 token pass is now the Gluon
# kernel (scripts/cold_start.py at (4,4096,32,64), which runs that unit).
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); python3 -m dplr_gen.cli build specs/hopper.yaml -j 16 > $OUT/build_hopper.log 2>&1; echo "build rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 $OUT/build_hopper.log
timeout 300 python3 scripts/cold_start.py --shape 4x4096x32x64 2>&1 | tail -25

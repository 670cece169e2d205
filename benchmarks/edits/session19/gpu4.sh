#!/usr/bin/env bash
# session 19, GPU call 4: cold start of the prebuilt hopper package on the current code (scripts/cold_start.py,
# two shapes), last measured in session 14.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu4.log") 2>&1
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); python3 -m dplr_gen.cli build specs/hopper.yaml -j 16 > $OUT/build_hopper.log 2>&1; echo "build rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 $OUT/build_hopper.log
for s in 4x4096x32x64 8x2048x16x128; do
  timeout 240 python3 scripts/cold_start.py --shape $s && mv $OUT/cold_start.json $OUT/cold_start_$s.json
done

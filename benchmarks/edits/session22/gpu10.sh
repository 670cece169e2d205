#!/usr/bin/env bash
# session 22, GPU call 10: per-stage times of the varlen bench case and its 16-sequence dense twin with the
# persistent token pass (one-variant-group package of the shipped K = 64 knobs, dense and varlen)
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu10.log
python3 -m dplr_gen.cli build benchmarks/specs/session22/k64_ship.yaml -j 16 2>&1 | tail -1 | tee -a $OUT/gpu10.log
timeout 300 python3 $D/varlen_stages.py generated/s22_k64_ship 2>&1 | tee -a $OUT/gpu10.log

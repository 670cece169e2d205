#!/usr/bin/env bash
# session 22, GPU call 4: the Gluon passes with the inputs' tiles loaded before the products (K = 64, 128)
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu4.log
timeout 150 python3 $D/run_units.py shipped=$D/k64_shipped_unit.py loadsfirst=$D/k64_loadsfirst.py static=$D/k64_static.py \
  --shapes 2x1000x4,8x4096x64,4x4096x32 --tag k64 --rounds 2 2>&1 | grep -v "^2x1000" | tee -a $OUT/gpu4.log
timeout 200 python3 $D/run_units.py shipped=$D/k128_shipped_unit.py branch=$D/k128_static_branch.py loadsfirst=$D/k128_branch_loadsfirst.py \
  --shapes 2x1000x4,8x2048x16 --tag k128 --rounds 2 2>&1 | tee -a $OUT/gpu4.log

#!/usr/bin/env bash
# session 22, GPU call 2: K = 64: the shipped Gluon pass against the rewritten one (V blocks unrolled), the same
# file twice (order effects); K = 128: the Gluon pass with the derived steps in branches / masked, against the
# shipped Triton pass.
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
timeout 150 python3 $D/run_units.py shipped=$D/k64_shipped_unit.py new=$D/k64_static.py shipped2=$D/k64_shipped_unit.py new2=$D/k64_static.py \
  --shapes 2x1000x4,8x4096x64 --tag k64 --rounds 2 2>&1 | grep -v "^2x1000" | tee $OUT/gpu2.log
timeout 200 python3 $D/run_units.py shipped=$D/k128_shipped_unit.py branch=$D/k128_static_branch.py masked=$D/k128_static_masked.py \
  --shapes 2x1000x4,8x2048x16 --tag k128 --rounds 2 2>&1 | tee -a $OUT/gpu2.log

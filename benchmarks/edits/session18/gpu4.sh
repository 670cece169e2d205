#!/usr/bin/env bash
# session 18, GPU call 5: instruction-order edits of the K = 64 backward prep (prep_both_k64.json), JIT-timed
# (scripts/time_token_edits.py --kernel prep_bwd) as the shared prep (store_fwd_ops=1) and as a recompute runs it.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu4.log") 2>&1
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
U=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
E=benchmarks/edits/session18/prep_both_k64.json
for r in 1 2; do
  python3 scripts/time_token_edits.py $U --kernel prep_bwd --edits $E --shape 8x4096x64 --switch store_fwd_ops=1 | sed "s/^/r$r both: /"
  python3 scripts/time_token_edits.py $U --kernel prep_bwd --edits $E --shape 8x4096x64 | sed "s/^/r$r recompute: /"
  python3 scripts/time_token_edits.py $U --kernel prep_bwd --edits $E --shape 4x4096x32 --switch store_fwd_ops=1 | sed "s/^/r$r both: /"
  mkdir -p $OUT/r$r && mv $OUT/prep_bwd_edits_*.json $OUT/r$r/
done
(cd $OUT && tar czf s18_gpu4.tgz r1 r2 gpu4.log)

#!/usr/bin/env bash
# session 18, GPU call 6: the [C, C] stores before the inverse (cc_first) at K = 128 (W already last there) and
# with W last at K = 64 on (4, 4096, 32, 64), JIT-timed as the shared prep and as a recompute runs the backward prep.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu5.log") 2>&1
. scripts/gpu_setup.sh
U64=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
U128=generated/hopper/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
E=benchmarks/edits/session18
for r in 1 2; do
  python3 scripts/time_token_edits.py $U128 --kernel prep_bwd --edits $E/prep_both_k128.json --shape 8x2048x16 | sed "s/^/r$r recompute: /"
  python3 scripts/time_token_edits.py $U128 --kernel prep_bwd --edits $E/prep_both_k128.json --shape 8x2048x16 --switch store_fwd_ops=1 | sed "s/^/r$r both: /"
  python3 scripts/time_token_edits.py $U128 --kernel prep_bwd --edits $E/prep_both_k128.json --shape 8x2048x16 --switch store_pass_ops=0 | sed "s/^/r$r lean: /"
  python3 scripts/time_token_edits.py $U64 --kernel prep_bwd --edits $E/prep_both_k64_b.json --shape 4x4096x32 | sed "s/^/r$r recompute: /"
  python3 scripts/time_token_edits.py $U64 --kernel prep_bwd --edits $E/prep_both_k64_b.json --shape 8x4096x64 --switch store_pass_ops=0 | sed "s/^/r$r lean: /"
  mkdir -p $OUT/r$r && mv $OUT/prep_bwd_edits_*.json $OUT/r$r/
done
(cd $OUT && tar czf s18_gpu5.tgz r1 r2 gpu5.log)

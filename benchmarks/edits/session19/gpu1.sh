#!/usr/bin/env bash
# session 19, GPU call 1: TMA (device-side tensor descriptor) loads/stores in the token pass, JIT-timed against
# the shipped form (scripts/time_token_edits.py), two rounds, K = 64 and K = 128.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu1.log") 2>&1
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
U64=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
U128=generated/hopper/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
for r in 1 2; do
  timeout 200 python3 scripts/time_token_edits.py $U64 --shape 8x4096x64 --edits benchmarks/edits/session19/tma_k64.json && mv $OUT/token_edits_8x4096x64.json $OUT/k64_8x4096x64_r$r.json
  timeout 120 python3 scripts/time_token_edits.py $U128 --shape 8x2048x16 --edits benchmarks/edits/session19/tma_k128.json && mv $OUT/token_edits_8x2048x16.json $OUT/k128_8x2048x16_r$r.json
done
timeout 120 python3 scripts/time_token_edits.py $U64 --shape 4x4096x32 --edits benchmarks/edits/session19/tma_k64.json && mv $OUT/token_edits_4x4096x32.json $OUT/k64_4x4096x32_r1.json
(cd $OUT && tar czf s19_gpu1.tgz *.json gpu1.log)

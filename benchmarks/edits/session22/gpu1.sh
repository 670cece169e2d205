#!/usr/bin/env bash
# session 22, GPU call 1: the Gluon token pass at K = 128 (64-wide K blocks, V loop, states derived for every
# second chunk) against the shipped Triton pass, same inputs; the K = 64 Gluon pass as rewritten (loop of one
# V block) against the shipped one.
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
G=generated/hopper
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu1.log
timeout 200 python3 $D/run_units.py shipped=$D/k128_shipped_unit.py gluon=$G/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py \
  --shapes 1x48x2,2x1000x4,3x999x5,8x2048x16 --tag k128 --rounds 3 2>&1 | tee -a $OUT/gpu1.log
timeout 150 python3 $D/run_units.py shipped=$D/k64_shipped_unit.py gluon=$G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py \
  --shapes 2x1000x4,8x4096x64 --tag k64 --rounds 2 2>&1 | tee -a $OUT/gpu1.log

#!/usr/bin/env bash
# session 22, GPU call 8: the persistent pipelined token pass as the template renders it (generated/hopper),
# dense units with w in bf16 and in fp32, against session 21's shipped Gluon pass (run_units.py runs a
# persistent kernel at one program per item: correctness only there); then timed at its persistent grid
# (tok_persist_time.py)
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
G=generated/hopper
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu8.log
timeout 120 python3 $D/run_units.py old=$D/k64_shipped_unit.py new=$G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py \
  --shapes 2x1000x4,1x37x3,8x4096x64 --tag k64_gbf16 --rounds 0 2>&1 | tee -a $OUT/gpu8.log
timeout 120 python3 $D/run_units.py old=$D/k64_gfp32_shipped_unit.py new=$G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gfp32_sfp32/sm_90.py \
  --shapes 2x1000x4,8x4096x64 --tag k64_gfp32 --rounds 0 2>&1 | tee -a $OUT/gpu8.log
timeout 200 python3 $D/tok_persist_time.py $D/k64_shipped_unit.py $G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py \
  --shapes 8x4096x64,4x4096x32 2>&1 | tee -a $OUT/gpu8.log
timeout 200 python3 $D/tok_persist_time.py $D/k64_gfp32_shipped_unit.py $G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gfp32_sfp32/sm_90.py \
  --shapes 8x4096x64 2>&1 | tee -a $OUT/gpu8.log

#!/usr/bin/env bash
# session 21, GPU call 5: the shipped Gluon token pass (tok_gluon4.py base = the template's kernel) against two
# edits: v^T, u^T taken from the v, u fragments (no second load), and the token scans as 3xTF32 products (no
# shared memory, no barrier left); outputs compared with the shipped Triton form, then timed.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
. scripts/gpu_setup.sh > /dev/null
U=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
D=benchmarks/edits/session21
timeout 250 python3 $D/run_tok.py $U $D/tok_gluon4.py --shapes "2x1000x4,8x4096x64,4x4096x32" --rounds 3 \
  --forms "base:token_pass_v4_base:4:0,mvt:token_pass_v4_mvt:4:0,scan:token_pass_v4_scan:4:0,both:token_pass_v4_both:4:0,both168:token_pass_v4_both:4:168" 2>&1 | tee $OUT/gpu5.log

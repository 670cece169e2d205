#!/usr/bin/env bash
# session 21, GPU call 3: Gluon token pass with coalesced loads (tok_gluon2.py: 16-byte operand loads,
# v permuted; tok_gluon3.py: the V products one 16-wide block of v at a time, 8-byte loads), uncapped and capped,
# against the shipped kernel on the same inputs.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
. scripts/gpu_setup.sh > /dev/null
U=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
D=benchmarks/edits/session21
for m in 2 3; do
  timeout 200 python3 $D/run_tok.py $U $D/tok_gluon$m.py --shapes "2x1000x4,8x4096x64,4x4096x32" \
    --forms "v$m:token_pass_gluon$m:4:0,v${m}c232:token_pass_gluon$m:4:232,v${m}c200:token_pass_gluon$m:4:200" 2>&1 | tee -a $OUT/gpu3.log
  mv $OUT/gluon_token.json $OUT/gluon_token_v$m.json
done

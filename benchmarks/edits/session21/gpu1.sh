#!/usr/bin/env bash
# session 21, GPU call 1: the K = 64 token pass written in Gluon (benchmarks/edits/session21/tok_gluon.py:
# operands loaded straight into MMA register fragments, elementwise work in the accumulator layout, ~no shared
# memory) against the shipped Triton kernel on the same inputs: outputs compared, then do_bench medians.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
. scripts/gpu_setup.sh > /dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
U=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
D=benchmarks/edits/session21
timeout ${T1:-400} python3 $D/run_tok.py $U $D/tok_gluon.py --shapes "${SHAPES:-2x1000x4,8x4096x64,4x4096x32}" \
  --forms "${FORMS:-g4:token_pass_gluon:4:0,g4c168:token_pass_gluon:4:168,g8:token_pass_gluon:8:0,g8c128:token_pass_gluon:8:128,g4c128:token_pass_gluon:4:128}" 2>&1 | tee $OUT/gpu1.log
echo "rc=$?"

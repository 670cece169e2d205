#!/usr/bin/env bash
# session 22, GPU call 6: the persistent, cp.async-pipelined K = 64 token pass prototype (tok_pipe.py) against
# the shipped Gluon pass, 1-3 programs an SM, 255 / 168 registers
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu6.log
timeout 300 python3 $D/tok_pipe.py $D/k64_shipped_unit.py --shapes 2x1000x4,1x37x3,8x4096x64,4x4096x32 --ctas 1,2,3 --regs 255,168 2>&1 | tee -a $OUT/gpu6.log

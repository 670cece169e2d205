#!/usr/bin/env bash
# session 22, GPU call 7: tok_pipe.py with one shared allocation per tile (no barriers between the copies), with
# and without the permuted K columns (8-byte stores), against the shipped Gluon pass
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu7.log
timeout 300 python3 $D/tok_pipe.py $D/k64_shipped_unit.py --shapes 2x1000x4,1x37x3,8x4096x64,4x4096x32 --ctas 2 --regs 255 --kperm 0,1 --rounds 3 2>&1 | tee -a $OUT/gpu7.log

#!/usr/bin/env bash
# session 22, GPU call 18: the dense persistent token pass locating its items by arithmetic against the same
# kernel reading them from a per-slot table (does a loaded item location cost what varlen loses?)
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu18.log
timeout 200 python3 $D/direct_dense.py $D/exp_dense_db570c1.py table=$D/exp_dense_table.py smem=$D/exp_dense_table_smem.py 16x2048x32 2>&1 | tee -a $OUT/gpu18.log

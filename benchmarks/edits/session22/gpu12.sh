#!/usr/bin/env bash
# session 22, GPU calls 12-13: the varlen token pass alone (mixed / equal lengths) and the dense twin, persistent
# (built package) against session 21's units
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu12.log
python3 -m dplr_gen.cli build benchmarks/specs/session22/k64_ship.yaml -j 16 2>&1 | tail -1 | tee -a $OUT/gpu12.log
timeout 300 python3 $D/varlen_tok.py generated/s22_k64_ship $D/k64_shipped_unit.py $D/k64_varlen_shipped_unit.py v_db570c1=$D/exp_varlen_db570c1.py d_db570c1=$D/exp_dense_db570c1.py 2>&1 | tee -a $OUT/gpu12.log

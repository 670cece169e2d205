#!/usr/bin/env bash
# session 22, GPU calls 18, 21, 22, 25, 26 (the forms compared varied; perf_notes 49): the dense persistent token
# pass locating its items by arithmetic against the same kernel locating them otherwise (does a loaded item
# location cost what varlen loses?)
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
python3 $D/mk_location_forms.py  # the forms, from their base unit and location_forms.json, into $D/forms
F=$D/forms
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu18.log
timeout 200 python3 $D/direct_dense.py $D/exp_dense_db570c1.py table=$F/exp_dense_table.py smem=$F/exp_dense_table_smem.py 16x2048x32 2>&1 | tee -a $OUT/gpu18.log

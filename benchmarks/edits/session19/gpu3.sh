#!/usr/bin/env bash
# session 19, GPU call 3: upper bound of the reverse pass beside the token pass (keep mode)
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu3.log") 2>&1
. scripts/gpu_setup.sh
x=s19_base
python3 -m dplr_gen.cli build benchmarks/edits/session19/$x.yaml -j 16 > $OUT/build_$x.log 2>&1; tail -2 $OUT/build_$x.log
timeout 300 python3 benchmarks/edits/session19/overlap_bound.py generated/$x

#!/usr/bin/env bash
# session 22, GPU call 3: what the JIT compiled on the GPU for the shipped and rewritten K = 64 Gluon passes
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
python3 $D/jit_dump.py 8x4096x64 shipped=$D/k64_shipped_unit.py new=$D/k64_static.py 2>&1 | tee $OUT/gpu3.log
python3 $D/cpu_compile.py $D/k64_static.py --divisible T H 2>&1 | tail -3 | tee -a $OUT/gpu3.log

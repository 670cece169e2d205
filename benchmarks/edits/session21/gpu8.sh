#!/usr/bin/env bash
# session 21, GPU call 8: gpu_check job `varlen` again, now with a case whose w is fp32 (the gfp32 units) (9 sequences of 1..1000 tokens, bf16, D=64 and 128)
# on the hopper package: the Gluon token pass's varlen slot map against float64 (the table's bf16 bounds).
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); python3 -m dplr_gen.cli build specs/hopper.yaml -j 16 > $OUT/build_hopper.log 2>&1; echo "build rc=$? in $(( $(date +%s) - t0 )) s"
timeout 300 python3 scripts/gpu_check.py --only varlen 2>&1 | tail -12

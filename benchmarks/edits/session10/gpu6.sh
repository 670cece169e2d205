#!/usr/bin/env bash
# session 10, GPU call 6: the token pass's token-axis scans and sums as FMA dots with triangular matrices
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu6.log") 2>&1
G=generated/hopper
te() { python3 scripts/time_token_edits.py "$1" --shape "$2" --edits "$3"; mv $OUT/token_edits_$2.json "$OUT/te_$4.json"; }
for r in 1 2; do
te $G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py 4x4096x32 benchmarks/edits/token_dot_scans.json k64_4x4096x32_$r
te $G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py 8x4096x64 benchmarks/edits/token_dot_scans.json k64_8x4096x64_$r
te $G/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py 8x2048x16 benchmarks/edits/token_dot_scans.json k128_8x2048x16_$r
done
(cd $OUT && tar czf te.tgz te_*.json && rm te_*.json)

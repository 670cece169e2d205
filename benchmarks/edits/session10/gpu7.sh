#!/usr/bin/env bash
# session 10, GPU call 7: token-pass candidates with K split over programs (knob block_k), rendered on the CPU
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu7.log") 2>&1
G=generated/hopper
t1() { python3 scripts/time_token_edits.py "$1" --shape "$2" | sed "s|shipped|$3|"; mv $OUT/token_edits_$2.json "$OUT/te_$3_$2.json"; }
for r in 1 2; do
  t1 $G/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py 8x2048x16 k128_base_$r
  for c in c1 c2 c3 c4 c4b c5 c6; do t1 .exp/cand/k128_$c.py 8x2048x16 k128_${c}_$r; done
  for sh in 4x4096x32 8x4096x64; do
    t1 $G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py $sh k64_base_$r
    for c in d1 d1b d2 d3; do t1 .exp/cand/k64_$c.py $sh k64_${c}_$r; done
  done
done
(cd $OUT && tar czf te.tgz te_*.json && rm te_*.json)

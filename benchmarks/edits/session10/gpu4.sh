#!/usr/bin/env bash
# session 10, GPU call 4: token pass, inputs loaded before the V loop and gates formed after it (new) vs before (base)
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu4.log") 2>&1
G=generated/hopper
N64=$G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
N128=$G/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
te() { python3 scripts/time_token_edits.py "$1" --shape "$2" --edits "$3"; mv $OUT/token_edits_$2.json "$OUT/te_$4.json"; }
for r in 1 2; do
  for sh in 4x4096x32 8x4096x64; do
    te .exp/base_k64.py $sh .exp/e_base64.json base64_${sh}_$r
    te $N64 $sh .exp/e_new64.json new64_${sh}_$r
  done
  te .exp/base_k128.py 8x2048x16 .exp/e_128.json base128_$r
  te $N128 8x2048x16 .exp/e_128.json new128_$r
done
(cd $OUT && tar czf te.tgz te_*.json && rm te_*.json)

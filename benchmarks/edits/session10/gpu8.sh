#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu8.log") 2>&1
t1() { python3 scripts/time_token_edits.py "$1" --shape "$2" | sed "s|shipped|$3|"; mv $OUT/token_edits_$2.json "$OUT/te_$3_$2.json"; }
for r in 1 2; do for c in c2 c2_bv32 c2_s3 c2_bv128 c2_bv16; do t1 .exp/cand/k128_$c.py 8x2048x16 k128_${c}_$r; done; done
(cd $OUT && tar czf te.tgz te_*.json && rm te_*.json)

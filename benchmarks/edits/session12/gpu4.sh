#!/usr/bin/env bash
# session 12, GPU call 4 (review): the shipped K = 128 token pass before / after _kept_step sums the states pass's
# way (no division by the scale) and the kept slot comes from _sequence; JIT-timed, alternating, three rounds
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu4.log") 2>&1
. scripts/gpu_setup.sh >/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.exp/s12
for r in 1 2 3; do
  for f in before after; do
    python3 scripts/time_token_edits.py $S/tok_ship_$f.py --kernel bwd --shape 8x2048x16 | sed "s/^/${f}_$r /"
    mv "$OUT/token_edits_8x2048x16.json" "$OUT/te_${f}_$r.json"
  done
done
(cd $OUT && tar czf s12_gpu4.tgz te_*.json && rm -f te_*.json)

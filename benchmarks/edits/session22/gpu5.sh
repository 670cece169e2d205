#!/usr/bin/env bash
# session 22, GPU call 5: (1) the K = 128 Gluon pass taking one derived-state step per program without a branch,
# inputs loaded before / after the products, against the shipped Triton pass; (2) the K = 64 Gluon pass deriving
# every second state (states kept every 32 tokens) against its own Triton form; (3) op level, one-variant
# packages: K = 64 shipped knobs against states_every 32, two alternating rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu5.log") 2>&1
T0=$(date +%s)
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(python3 -m dplr_gen.cli build benchmarks/specs/session22/k64_ship.yaml -j 4 > $OUT/build_ship.log 2>&1;
 python3 -m dplr_gen.cli build benchmarks/specs/session22/k64_derive.yaml -j 4 > $OUT/build_derive.log 2>&1) &
BPID=$!
timeout 200 python3 $D/run_units.py shipped=$D/k128_shipped_unit.py first=$D/k128_onestep_loadsfirst.py last=$D/k128_onestep_loadslast.py \
  --shapes 1x48x2,2x1000x4,8x2048x16 --tag k128 --rounds 2
timeout 150 python3 $D/run_units.py triton=$D/k64_derive_unit.py@triton gluon=$D/k64_derive_unit.py \
  --shapes 1x48x2,2x1000x4,8x4096x64,4x4096x32 --tag k64_derive --rounds 2
wait $BPID; tail -1 $OUT/build_ship.log $OUT/build_derive.log
echo "== builds done at $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  for p in s22_k64_ship s22_k64_derive; do
    timeout 150 python3 benchmarks/bench.py --package generated/$p --systems dplr-fast --shapes 8x4096x64x64,4x4096x32x64 --no-accuracy \
      | sed -n '/^speed/,/^$/p'
    mv "$OUT"/bench_*.json "$OUT/ab_${p}_bench_${round}.json" 2>/dev/null; rm -f "$OUT"/bench_*.png
  done
done
echo "== done at $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# One GPU call: build specs/hopper.yaml and a candidate spec (default benchmarks/specs/token_stages3.yaml), then
# time both, alternating, per stage (benchmarks/tune.py --package) and per op (benchmarks/bench.py --package,
# dplr-gen only). Results to $OUT: ab_<package>_{tune,bench}_<round>.json and gpu_ab_package.log.
#   scripts/gpu_ab_package.sh [CANDIDATE_SPEC] [SHAPES]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_ab_package.log") 2>&1
CAND="${1:-benchmarks/specs/token_stages3.yaml}"
SHAPES="${2:-4x4096x32x64,8x2048x16x128}"
T0=$(date +%s)
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m dplr_gen.cli build specs/hopper.yaml -j 10 > /tmp/b_hopper.log 2>&1 &
BUILD_PID=$!
python3 -m dplr_gen.cli build "$CAND" -j 6 | tail -1
wait "$BUILD_PID"; tail -1 /tmp/b_hopper.log  # waits on the PID: a bare `wait` would wait for the tee too
CNAME=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$CAND")
echo "== builds done at $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  for p in hopper "$CNAME"; do
    python3 benchmarks/tune.py --package "generated/$p" --dims 64,128 --chunks 16 | tail -2
    mv "$OUT"/tune_*.json "$OUT/ab_${p}_tune_${round}.json" 2>/dev/null
    python3 benchmarks/bench.py --package "generated/$p" --systems dplr-fast --shapes "$SHAPES" --no-accuracy \
      | sed -n '/^speed/,/^$/p'
    mv "$OUT"/bench_*.json "$OUT/ab_${p}_bench_${round}.json" 2>/dev/null; rm -f "$OUT"/bench_*.png
  done
done
echo "== done in $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# One GPU call: build a base spec and a candidate spec, then time both, alternating, per stage
# (benchmarks/tune.py --package) and per op (benchmarks/bench.py --package, dplr-gen only). Results to $OUT:
# ab_<package>_{tune,bench}_<round>.json and gpu_ab_package.log.
#   [BASE_TREE=DIR] [BASE_SPEC=SPEC] scripts/gpu_ab_package.sh [CANDIDATE_SPEC] [SHAPES]
# BASE_SPEC (default specs/hopper.yaml) is built and timed inside BASE_TREE (default: this checkout) with that
# tree's own dplr_gen, templates and benchmarks: a template or driver change is timed against an earlier commit
# by handing its copy (git archive <commit> dplr_gen templates benchmarks scripts specs | tar -x -C DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_ab_package.log") 2>&1
CAND="${1:-benchmarks/specs/token_stages3.yaml}"
SHAPES="${2:-4x4096x32x64,8x2048x16x128}"
BASE_TREE="${BASE_TREE:-.}"
BASE_SPEC="${BASE_SPEC:-specs/hopper.yaml}"
T0=$(date +%s)
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(cd "$BASE_TREE" && python3 -m dplr_gen.cli build "$BASE_SPEC" -j 10) > /tmp/b_base.log 2>&1 &
BUILD_PID=$!
python3 -m dplr_gen.cli build "$CAND" -j 6 | tail -1
wait "$BUILD_PID"; tail -1 /tmp/b_base.log  # waits on the PID: a bare `wait` would wait for the tee too
spec_name() { python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$1"; }
BNAME=$(spec_name "$BASE_TREE/$BASE_SPEC")
CNAME=$(spec_name "$CAND")
echo "== builds done at $(( $(date +%s) - T0 )) s: base $BNAME (in $BASE_TREE), candidate $CNAME"
for round in 1 2; do
  for side in base cand; do
    if [ "$side" = base ]; then tree="$BASE_TREE" p="$BNAME"; else tree=. p="$CNAME"; fi
    (
      cd "$tree" || exit
      python3 benchmarks/tune.py --package "generated/$p" --dims 64,128 --chunks 16 | tail -2
      python3 benchmarks/bench.py --package "generated/$p" --systems dplr-fast --shapes "$SHAPES" --no-accuracy \
        | sed -n '/^speed/,/^$/p'
    )
    mv "$OUT"/tune_*.json "$OUT/ab_${p}_tune_${round}.json" 2>/dev/null
    mv "$OUT"/bench_*.json "$OUT/ab_${p}_bench_${round}.json" 2>/dev/null; rm -f "$OUT"/bench_*.png
  done
done
echo "== done in $(( $(date +%s) - T0 )) s"

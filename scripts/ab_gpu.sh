#!/usr/bin/env bash
# One GPU call: the working tree (candidate) against a base tree (scripts/ab_base.sh), each built as the
# package of one spec (a one-variant-group spec keeps the builds short), in four steps:
#   1. both packages built at once;
#   2. o, ht and every gradient compared bit for bit (scripts/ab_outputs.py): "all bit-identical" or the list;
#   3. op level: benchmarks/bench.py --no-accuracy, base and candidate alternating for ROUNDS rounds, fla-best in
#      the candidate's first round (the same-run peer);
#   4. per stage: benchmarks/tune.py --package with STAGES, alternating, while the budget lasts.
# Everything lands in $OUT/ab.tgz and $OUT/ab.log. DRY=1 runs the same steps on the CPU (packages rendered, not
# compiled; the interpreter on tiny shapes; bench.py --dry-run; no fla): the test suite runs it that way.
#   device: SPEC=benchmarks/specs/x.yaml [BASE_SPEC=...] [SHAPES=...] [ROUNDS=2] [STAGES="--dims 64 ..."] \
#           [SYSTEMS=dplr-fast,dplr-keep] [FLA=1] [BUDGET=540] [BASE_DIR=.exp/ab/base] scripts/ab_gpu.sh
# (spec paths relative to the trees' roots; CAND_DIR, default this repo, is where the candidate is built)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${SPEC:?SPEC=the candidate spec path, relative to the repo root}"
BASE_SPEC=${BASE_SPEC:-$SPEC}; BASE_DIR=${BASE_DIR:-.exp/ab/base}; DRY=${DRY:-0}
SHAPES=${SHAPES:-4x4096x32x64,8x4096x64x64,8x2048x16x128}; ROUNDS=${ROUNDS:-2}
STAGES=${STAGES---chunks 16 --dims 64 --time-shape 8x4096x64}  # (STAGES= : no stage timing)
SYSTEMS=${SYSTEMS:-dplr-fast,dplr-keep}
ROOT=$PWD; TMP=$(mktemp -d)
abs() { case $1 in /*) echo "$1" ;; *) echo "$ROOT/$1" ;; esac; }
BASE_DIR=$(abs "$BASE_DIR"); CAND_DIR=$(abs "${CAND_DIR:-.}")
case "$SPEC$BASE_SPEC" in /*) echo "ab_gpu.sh: give SPEC and BASE_SPEC relative to the repo root" >&2; exit 2 ;; esac
[ -d "$BASE_DIR/dplr_gen" ] || { echo "ab_gpu.sh: no base tree in $BASE_DIR (scripts/ab_base.sh REF, then carry .exp)" >&2; exit 2; }
[ -f "$SPEC" ] && [ -f "$BASE_SPEC" ] || { echo "ab_gpu.sh: spec $SPEC or $BASE_SPEC not found" >&2; exit 2; }
export OUT="$(abs "${OUT:-out}")" PYTHONUNBUFFERED=1  # absolute: bench.py and tune.py write there from either tree
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/ab.log") 2>&1
T0=$(date +%s); END=$(( T0 + ${BUDGET:-540} ))
left() { [ "$(date +%s)" -lt "$((END - $1))" ]; }
DRY_OUTPUTS=""; DRY_BENCH=""
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1; FLA=0
  DRY_OUTPUTS="--device cpu --shapes 1x40x1x64"; DRY_BENCH="--dry-run"  # (tune.py takes the same flag)
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  . scripts/gpu_setup.sh  # the carried wheels into /tmp/site; fla's autotune choices restored
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
name() { python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$1"; }
mkdir -p "$CAND_DIR/$(dirname "$SPEC")"; [ -f "$CAND_DIR/$SPEC" ] || cp "$SPEC" "$CAND_DIR/$SPEC"
mkdir -p "$BASE_DIR/$(dirname "$BASE_SPEC")" && cp "$BASE_SPEC" "$BASE_DIR/$BASE_SPEC"
declare -A DIR=([base]="$BASE_DIR" [cand]="$CAND_DIR") PKG=([base]="generated/$(name "$BASE_SPEC")" [cand]="generated/$(name "$SPEC")")
declare -A SPECS=([base]="$BASE_SPEC" [cand]="$SPEC")
COMMIT_BASE="$(cat "$BASE_DIR/.ab_ref" 2>/dev/null || echo unknown) (ab base)"
declare -A COMMIT=([base]="$COMMIT_BASE" [cand]="$(cd "$CAND_DIR" && git rev-parse HEAD 2>/dev/null || cat .ab_ref 2>/dev/null || echo unknown) + working tree (ab candidate)")
in_tree() { local x=$1; shift; (cd "${DIR[$x]}" && PYTHONPATH="/tmp/site:${DIR[$x]}" DPLR_GEN_COMMIT="${COMMIT[$x]}" "$@"); }
pids=()
for x in base cand; do
  if [ "$DRY" = 1 ]; then
    in_tree $x python3 -c "import sys; from dplr_gen import build; p = build.plan(sys.argv[1]); build.write_package(p); \
print(p.out_dir, 'rendered')" "${SPECS[$x]}" > "$OUT/ab/build_$x.log" 2>&1 &
  else
    in_tree $x python3 -m dplr_gen.cli build "${SPECS[$x]}" -j 8 > "$OUT/ab/build_$x.log" 2>&1 &
  fi
  pids+=($!)
done
wait "${pids[@]}"  # (a bare `wait` would also wait for the tee above: forever)
echo "== builds done at $(( $(date +%s) - T0 )) s"; tail -n 2 "$OUT"/ab/build_*.log
for x in base cand; do
  in_tree $x timeout 120 python3 "$ROOT/scripts/ab_outputs.py" --package "${PKG[$x]}" --out "$TMP/ab_$x.pt" $DRY_OUTPUTS
done
python3 scripts/ab_outputs.py --compare "$TMP/ab_base.pt" "$TMP/ab_cand.pt" | tail -n 25
echo "== outputs compared at $(( $(date +%s) - T0 )) s"
for r in $(seq "$ROUNDS"); do
  for x in base cand; do
    left 60 || { echo "== budget spent before op round $r ($x)"; break 2; }
    sys=$SYSTEMS; [ "${FLA:-1}" = 1 ] && [ $x = cand ] && [ "$r" = 1 ] && sys="$SYSTEMS,fla-best"
    in_tree $x timeout 240 python3 benchmarks/bench.py --package "${PKG[$x]}" --systems "$sys" --shapes "$SHAPES" \
      --no-accuracy --budget 230 $DRY_BENCH 2>&1 | grep -E '^ *[0-9]+x|^varlen|rror' | sed "s/^/$x r$r: /"
    for f in "$OUT"/bench_*.json; do [ -f "$f" ] && mv "$f" "$OUT/ab/op_${x}_$r.json"; done
    rm -f "$OUT"/bench_*.png
  done
done
echo "== op level done at $(( $(date +%s) - T0 )) s"
if [ -n "$STAGES" ]; then
  for r in $(seq "$ROUNDS"); do
    for x in base cand; do
      left 90 || { echo "== budget spent before stage round $r ($x)"; break 2; }
      # shellcheck disable=SC2086
      in_tree $x timeout 85 python3 benchmarks/tune.py --package "${PKG[$x]}" $STAGES $DRY_BENCH 2>&1 | grep -E '^D=|FAIL|rror' \
        | sed "s/^/$x r$r: /"
      for f in "$OUT"/tune_*.json; do [ -f "$f" ] && mv "$f" "$OUT/ab/stage_${x}_$r.json"; done
    done
  done
fi
(cd "$OUT/ab" && tar czf "$OUT/ab.tgz" .) && rm -rf "$OUT/ab" "$TMP"
echo "== done at $(( $(date +%s) - T0 )) s"

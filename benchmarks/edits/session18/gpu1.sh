#!/usr/bin/env bash
# session 18, GPU call 1: the forward that keeps the states runs the backward's prep (ops.PREP_IN_FORWARD):
# per stage (tune.py --package: prep_both, fwd_kept, fwd_train) and op level A/B (benchmarks/edits/session18/ab_prep_in_fwd.py), two rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu1.log") 2>&1
T0=$(date +%s); END=$(( T0 + ${BUDGET:-540} ))
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
x=s18_base
python3 -m dplr_gen.cli build benchmarks/edits/session18/$x.yaml -j 8 > $OUT/build_$x.log 2>&1
echo "== build done at $(( $(date +%s) - T0 )) s"; grep -h "failed" $OUT/build_*.log
stage() { [ "$(date +%s)" -lt "$((END - 60))" ] || { echo "== budget spent: stage $1 $2"; return; }
  if [ "$2" = default ]; then a=(--dims 64,128); else a=(--dims 64 --time-shape "$2"); fi
  timeout 150 python3 benchmarks/tune.py --package generated/$1 --chunks 16 "${a[@]}" 2>&1 | grep -E '^D=|FAIL|rror' | sed "s/^/$1 $2 r$3: /"
  mv "$OUT"/tune_*.json "$OUT/stage_${1}_${2}_$3.json" 2>/dev/null; }
stage $x default 1
stage $x 8x4096x64 1
timeout 240 python3 benchmarks/edits/session18/ab_prep_in_fwd.py generated/$x $OUT/ab_$x.json 2 2>&1 | tail -n 40
stage $x default 2
stage $x 8x4096x64 2
(cd $OUT && tar czf s18_gpu1.tgz stage_*.json ab_*.json build_*.log 2>/dev/null)
echo "== done at $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# session 18, GPU calls 2 and 4 (`gpu2.sh s18_qwt`, `gpu2.sh s18_v2`; call 3 was `scripts/run_gpu.sh all`): the
# forward pass reading (Q e^gamma)^T and A_qk^T (the backward prep's layout) so the shared prep writes only A_qb extra (candidate, working tree) against
# commit 9f4ca3a (s18_base, built in .exp/s18/base): per stage (tune.py --package) and op level (bench.py --package,
# dplr-fast and dplr-keep), alternating.
# (.exp/s18/base held `git archive 9f4ca3a dplr_gen templates benchmarks scripts specs pyproject.toml` plus
#  g/s18_base.yaml; the candidates are qwt_transposed.diff (s18_qwt) and qwt_transposed_v2.diff (s18_v2) applied to
#  that commit; call 4's log and archive are named gpu3.log / s18_gpu3.tgz)
set -uo pipefail
C=${1:-s18_qwt}
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu2.log") 2>&1
T0=$(date +%s); END=$(( T0 + ${BUDGET:-540} ))
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(cd .exp/s18/base && python3 -m dplr_gen.cli build g/s18_base.yaml -j 8 > $OUT/build_s18_base.log 2>&1) & B1=$!
python3 -m dplr_gen.cli build benchmarks/edits/session18/$C.yaml -j 8 > $OUT/build_$C.log 2>&1
wait $B1
echo "== builds done at $(( $(date +%s) - T0 )) s"; grep -h "failed" $OUT/build_*.log
tree() { [ "$1" = s18_base ] && echo .exp/s18/base || echo .; }
stage() { [ "$(date +%s)" -lt "$((END - 60))" ] || { echo "== budget spent: stage $1 $2"; return; }
  if [ "$2" = default ]; then a=(--dims 64,128); else a=(--dims 64 --time-shape "$2"); fi
  (cd $(tree $1) && timeout 150 python3 benchmarks/tune.py --package generated/$1 --chunks 16 "${a[@]}" 2>&1) | grep -E '^D=|FAIL|rror' | sed "s/^/$1 $2 r$3: /"
  mv "$OUT"/tune_*.json "$OUT/stage_${1}_${2}_$3.json" 2>/dev/null; }
op() { [ "$(date +%s)" -lt "$((END - 40))" ] || { echo "== budget spent: op $1"; return; }
  (cd $(tree $1) && timeout 150 python3 benchmarks/bench.py --package generated/$1 --systems dplr-fast,dplr-keep --shapes 8x4096x64x64,8x2048x16x128,4x4096x32x64 $3 --budget 140 2>&1) \
    | grep -E '^ *[0-9]+x|err|rel|dplr' | sed "s/^/$1 r$2: /"
  mv "$OUT"/bench_*.json "$OUT/op_${1}_$2.json" 2>/dev/null; rm -f "$OUT"/bench_*.png; }
for r in 1 2; do
  for x in s18_base $C; do stage $x default $r; stage $x 8x4096x64 $r; done
  for x in s18_base $C; do op $x $r "$([ $r = 1 ] && echo '' || echo --no-accuracy)"; done
done
(cd $OUT && tar czf s18_gpu2.tgz stage_*.json op_*.json build_*.log 2>/dev/null)
echo "== done at $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# session 18, GPU call 7: K = 64 forward-pass knobs (stage chunk.fwd) for the forward that keeps the states: per
# stage (tune.py --package: fwd, fwd_kept, fwd_train) and op level (dplr-fast, dplr-keep), alternating. (Its archive
# came after the 8 files a call returns: only the log was kept, benchmarks/results/fwd_knobs_k64_h100_2026-11-26o.log.)
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu6.log") 2>&1
T0=$(date +%s); END=$(( T0 + ${BUDGET:-540} ))
. scripts/gpu_setup.sh
P="s18_f1v32 s18_f2v64s3 s18_f1v64 s18_f2v32"
pids=(); for x in $P; do python3 -m dplr_gen.cli build benchmarks/edits/session18/specs/$x.yaml -j 4 > $OUT/build_$x.log 2>&1 & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
echo "== builds done at $(( $(date +%s) - T0 )) s"; grep -h "failed" $OUT/build_*.log
for r in 1 2; do
  for x in $P; do
    [ "$(date +%s)" -lt "$((END - 50))" ] || { echo "== budget spent"; break 2; }
    timeout 100 python3 benchmarks/tune.py --package generated/$x --chunks 16 --dims 64 --time-shape 8x4096x64 2>&1 | grep -E '^D=|rror' | sed "s/^/$x r$r: /"
    mv "$OUT"/tune_*.json "$OUT/stage_${x}_$r.json" 2>/dev/null
    timeout 100 python3 benchmarks/bench.py --package generated/$x --systems dplr-fast,dplr-keep --shapes 8x4096x64x64,varlen --no-accuracy --budget 90 2>&1 \
      | grep -E '^ *(8x|varlen)' | sed "s/^/$x r$r: /"
    mv "$OUT"/bench_*.json "$OUT/op_${x}_$r.json" 2>/dev/null; rm -f "$OUT"/bench_*.png
  done
done
(cd $OUT && tar czf s18_gpu6.tgz stage_*.json op_*.json build_*.log gpu6.log 2>/dev/null)
echo "== done at $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# session 12, GPU call 1: the K = 128 token pass over 16-token chunks deriving every second state (knob
# chunk.bwd.states_every: 32) against the shipped 32-token one; JIT timing of the pass, then per stage and op level
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu1.log") 2>&1
T0=$(date +%s); END=$(( T0 + 550 ))
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.exp/s12; SP=benchmarks/specs/session12
pids=()
for p in k128_base k128_d1 k128_d2; do
  python3 -m dplr_gen.cli build $SP/$p.yaml -j 5 > /tmp/build_$p.log 2>&1 & pids+=($!)
done
te() { python3 scripts/time_token_edits.py "$1" --kernel bwd --shape "$2" ${4:+--edits "$4"} | sed "s/^/$3 /"
       mv "$OUT/token_edits_$2.json" "$OUT/te_$3.json"; }
for r in 1 2; do
  te $S/tok_k128_base.py 8x2048x16 base_$r
  te $S/tok_k128_d1.py 8x2048x16 d1_$r $S/e_d1.json
done
echo "== edits done at $(( $(date +%s) - T0 )) s"
for p in "${pids[@]}"; do wait "$p"; done
for p in k128_base k128_d1 k128_d2; do tail -2 /tmp/build_$p.log; done
for r in 1 2; do
  for p in k128_base k128_d2 k128_d1; do
    [ "$(date +%s)" -lt "$((END - 40))" ] || { echo "== budget spent"; break 2; }
    python3 benchmarks/bench.py --package generated/$p --systems dplr-fast --shapes 8x2048x16x128,1x4096x2x128 \
      --no-accuracy --budget 60 2>&1 | tail -12 | sed "s/^/$p r$r: /"
    mv "$OUT"/bench_*.json "$OUT/op_${p}_$r.json" 2>/dev/null; rm -f "$OUT"/bench_*.png
  done
done
for p in k128_base k128_d2; do
  [ "$(date +%s)" -lt "$((END - 30))" ] || { echo "== budget spent"; break; }
  python3 benchmarks/tune.py --package generated/$p --dims 128 --chunks 16 | grep '^D=' | sed "s/^/$p stages: /"
  mv "$OUT"/tune_*.json "$OUT/stages_$p.json" 2>/dev/null
done
(cd $OUT && tar czf s12_gpu1.tgz te_*.json op_*.json stages_*.json 2>/dev/null && rm -f te_*.json op_*.json stages_*.json)
echo "== done at $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# session 12, GPU call 2: the token pass with the state tiles as the left operand (no [V, K] state copies; dO^T
# and dR^T read instead; template .exp/s12/alt) against the committed form, at K = 128 (16-token chunks deriving
# every second state) and K = 64 (shipped knobs): JIT timing of the pass, then op level from one-variant packages
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu2.log") 2>&1
T0=$(date +%s); END=$(( T0 + 560 ))
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.exp/s12; SP=benchmarks/specs/session12
pids=()
for p in k128_base k128_d3 k64_ship; do
  python3 -m dplr_gen.cli build $SP/$p.yaml -j 5 > /tmp/build_$p.log 2>&1 & pids+=($!)
done
te() { python3 scripts/time_token_edits.py "$1" --kernel bwd --shape "$2" ${4:+--edits "$4"} | sed "s/^/$3 /"
       mv "$OUT/token_edits_$2.json" "$OUT/te_$3.json"; }
for r in 1 2; do
  te $S/tok_k128_d1.py 8x2048x16 d1_$r $S/e_s3.json
  te $S/tok_k128_d1_lhs.py 8x2048x16 d1lhs_$r $S/e_s3.json
  te $S/tok_k128_base_lhs.py 8x2048x16 baselhs_$r
  te $S/tok_k64_ship.py 4x4096x32 k64ship_4x4096x32_$r
  te $S/tok_k64_lhs.py 4x4096x32 k64lhs_4x4096x32_$r $S/e_k64.json
  te $S/tok_k64_ship.py 8x4096x64 k64ship_8x4096x64_$r
  te $S/tok_k64_lhs.py 8x4096x64 k64lhs_8x4096x64_$r
done
echo "== edits done at $(( $(date +%s) - T0 )) s"
for p in "${pids[@]}"; do wait "$p"; done
cp templates/chunk_dplr.py.jinja /tmp/tmpl.bak && cp $S/alt/chunk_dplr.py.jinja templates/chunk_dplr.py.jinja
pids=()
for p in k128_d3lhs k64_lhs; do
  python3 -m dplr_gen.cli build $SP/$p.yaml -j 8 > /tmp/build_$p.log 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
cp /tmp/tmpl.bak templates/chunk_dplr.py.jinja
for p in k128_base k128_d3 k64_ship k128_d3lhs k64_lhs; do tail -2 /tmp/build_$p.log | head -1; done
echo "== builds done at $(( $(date +%s) - T0 )) s"
op() { python3 benchmarks/bench.py --package generated/$1 --systems dplr-fast --shapes $2 --no-accuracy --budget 60 2>&1 \
         | grep -E '^[0-9]+x' | sed "s/^/$1 r$3: /"
       mv "$OUT"/bench_*.json "$OUT/op_${1}_$3.json" 2>/dev/null; rm -f "$OUT"/bench_*.png; }
for r in 1 2; do
  for p in k128_base k128_d3 k128_d3lhs; do
    [ "$(date +%s)" -lt "$((END - 30))" ] || { echo "== budget spent"; break 2; }
    op $p 8x2048x16x128 $r
  done
  for p in k64_ship k64_lhs; do
    [ "$(date +%s)" -lt "$((END - 30))" ] || { echo "== budget spent"; break 2; }
    op $p 4x4096x32x64,8x4096x64x64 $r
  done
done
(cd $OUT && tar czf s12_gpu2.tgz te_*.json op_*.json 2>/dev/null && rm -f te_*.json op_*.json)
echo "== done at $(( $(date +%s) - T0 )) s"
if [ "$(date +%s)" -lt "$((END - 30))" ]; then  # may abort the process (MMA -> MMA conversion): last, on its own
  echo '{"w8": {"launch": {"num_warps": 8}}}' > /tmp/e_w8.json
  timeout $((END - $(date +%s))) python3 scripts/time_token_edits.py $S/tok_k128_d1_lhs.py --shape 8x2048x16 --edits /tmp/e_w8.json 2>&1 | tail -3
fi

#!/usr/bin/env bash
# session 11, GPU call 2: (a) the K = 128 token pass with gates after the V loop / the scan as a product at its
# [32, 64] tiles; (b) the backward prep's order (edits); (c) the K = 64 reverse pass at V tile 64 where its grid
# fills the device (the small-grid copy at 1 warp / V tile 32 below that)
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu2.log") 2>&1
END=$(( $(date +%s) + 540 ))
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.exp/s11
pids=()
for p in k64_base k64_r1 k64_r2 k64_r3; do
  python3 -m dplr_gen.cli build $S/$p.yaml -j 3 > /tmp/build_$p.log 2>&1 & pids+=($!)
done
U64=chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32
U128=chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32
te() { python3 scripts/time_token_edits.py "$1" --kernel "$2" --shape "$3" ${5:+--edits "$5"} | sed "s/^/$4 /"
       mv $OUT/$( [ $2 = bwd ] && echo token || echo $2 )_edits_$3.json "$OUT/te_$4.json"; }
for r in 1 2; do
  for f in ship ga ga_dot dot; do te $S/tok128_$f.py bwd 8x2048x16 tok128_${f}_$r; done
  te generated/hopper/$U128/sm_90.py prep_bwd 8x2048x16 prepbwd128_$r $S/e_prepbwd.json
  te generated/hopper/$U64/sm_90.py prep_bwd 4x4096x32 prepbwd64_$r $S/e_prepbwd.json
done
echo "== edits done at $(( $(date +%s) - END + 540 )) s"
for p in "${pids[@]}"; do wait "$p"; done
for p in k64_base k64_r1 k64_r2 k64_r3; do tail -1 /tmp/build_$p.log; done
for r in 1 2; do
  for p in k64_base k64_r1 k64_r2 k64_r3; do
    for sh in default 4x4096x64 8x4096x64; do
      [ "$(date +%s)" -lt "$END" ] || { echo "== budget spent"; break 3; }
      if [ $sh = default ]; then a=(); else a=(--time-shape $sh); fi
      python3 benchmarks/tune.py --package generated/$p --dims 64 --chunks 16 "${a[@]}" | grep '^D=' | sed "s/^/$p $sh r$r: /"
      mv "$OUT"/tune_*.json "$OUT/time_${p}_${sh}_$r.json" 2>/dev/null
    done
  done
done
(cd $OUT && tar czf s11_gpu2.tgz te_*.json time_*.json && rm -f te_*.json time_*.json)
echo "== done at $(( $(date +%s) - END + 540 )) s"

#!/usr/bin/env bash
# session 11, GPU call 1: (a) the preps split over K blocks / gate scan as a product (JIT, edits) against the
# committed (HEAD) units; (b) forward-pass knobs at K = 128 and the 32-token K = 64 token pass (packages, per stage)
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu1.log") 2>&1
END=$(( $(date +%s) + 560 ))
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=.exp/s11
pids=()
for p in k64_base k64_t1 k64_t2 k64_t4 k128_base k128_f1 k128_f2 k128_f3 k128_f4 k128_f5; do
  python3 -m dplr_gen.cli build $S/$p.yaml -j 2 > /tmp/build_$p.log 2>&1 & pids+=($!)
done
U64=chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32
U128=chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32
te() { python3 scripts/time_token_edits.py "$1" --kernel "$2" --shape "$3" ${5:+--edits "$5"} | sed "s/^/$4 /"
       mv $OUT/${2}_edits_$3.json "$OUT/te_$4.json"; }
for r in 1; do
  for k in prep prep_bwd; do
    te $S/base/$U128.py $k 8x2048x16 head128_${k}_$r
    te $S/new/$U128.py $k 8x2048x16 new128_${k}_$r $S/e_prep128.json
    te $S/base/$U64.py $k 4x4096x32 head64_${k}_4x4096x32_$r
    te $S/new/$U64.py $k 4x4096x32 new64_${k}_4x4096x32_$r $S/e_prep64.json
  done
done
echo "== edits done at $(( $(date +%s) - END + 560 )) s"
for p in "${pids[@]}"; do wait "$p"; done
for p in k64_base k64_t1 k64_t2 k64_t4 k128_base k128_f1 k128_f2 k128_f3 k128_f4 k128_f5; do tail -1 /tmp/build_$p.log; done
for r in 1 2; do
  for p in k128_base k128_f1 k128_f2 k128_f3 k128_f4 k128_f5 k64_base k64_t1 k64_t2 k64_t4; do
    [ "$(date +%s)" -lt "$END" ] || { echo "== budget spent"; break 2; }
    case $p in k64*) shapes="default 8x4096x64"; d=64 ;; *) shapes=default; d=128 ;; esac
    for sh in $shapes; do
      if [ $sh = default ]; then a=(); else a=(--time-shape $sh); fi
      python3 benchmarks/tune.py --package generated/$p --dims $d --chunks 16 "${a[@]}" | grep '^D=' | sed "s/^/$p $sh r$r: /"
      mv "$OUT"/tune_*.json "$OUT/time_${p}_${sh}_$r.json" 2>/dev/null
    done
  done
done
(cd $OUT && tar czf s11_gpu1.tgz te_*.json time_*.json && rm -f te_*.json time_*.json)
echo "== done at $(( $(date +%s) - END + 560 )) s"

#!/usr/bin/env bash
# session 21, GPU call 2: Gluon token-pass forms (tok_gluon.py) against the shipped kernel: the first form,
# the reordered "lean" one (outputs stored as soon as final), the [C, C] products split over the warps, the
# intra-chunk products on bf16 operands (192 registers); then ncu of the shipped kernel and of two forms.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
. scripts/gpu_setup.sh > /dev/null
U=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
D=benchmarks/edits/session21
timeout 300 python3 $D/run_tok.py $U $D/tok_gluon.py --shapes "2x1000x4,8x4096x64,4x4096x32" \
  --forms "g4:token_pass_gluon:4:0,lean:token_pass_lean:4:0,lean_split:token_pass_lean_split:4:0,lean_bf16:token_pass_lean_bf16:4:0,lean_bf16c168:token_pass_lean_bf16:4:168" 2>&1 | tee $OUT/gpu2.log
mv $OUT/gluon_token.json $OUT/gluon_token_s21b.json
which ncu || ls /usr/local/cuda*/bin/ncu
for f in "shipped:chunk_dplr_bwd_kernel:g4:token_pass_gluon:4:0" "lean_bf16:token_pass_lean_bf16:lean_bf16:token_pass_lean_bf16:4:0" "g4:token_pass_gluon:g4:token_pass_gluon:4:0"; do
  IFS=: read -r tag kname form fn w r <<< "$f"
  timeout 150 ncu --clock-control none --launch-count 1 -k regex:$kname --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 $D/run_tok.py $U $D/tok_gluon.py --shapes 4x4096x32 --rounds 0 --forms "$form:$fn:$w:$r" > $OUT/ncu_$tag.txt 2>&1
  echo "ncu $tag rc=$? $(grep -c . $OUT/ncu_$tag.txt) lines"
done
rm -f $OUT/gluon_token.json
cd $OUT && tar czf ncu_s21b.tgz ncu_*.txt && rm ncu_*.txt

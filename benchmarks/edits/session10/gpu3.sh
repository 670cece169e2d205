#!/usr/bin/env bash
# session 10, GPU call 3: token-pass stages/tiles/ablations on the capped shipped form; ncu source view
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu3.log") 2>&1
G=generated/hopper
U=$G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
E=benchmarks/edits
te() { python3 scripts/time_token_edits.py "$1" --shape "$2" --edits "$3"; mv $OUT/token_edits_$2.json "$OUT/te_$4.json"; }
te $U 4x4096x32 $E/token_edits_k64_c.json c_4x4096x32
te $U 8x4096x64 $E/token_edits_k64_c.json c_8x4096x64
for u in chunk_fp16_k64_v64_c16_dense_gbm0p61_gfp16_sfp32 chunk_bf16_k64_v64_c16_dense_gbm0p61_gfp32_sfp32; do te $G/$u/sm_90.py 4x4096x32 $E/token_stages3.json s3_$u; done
te $G/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py 8x2048x16 $E/token_edits_k128_c.json k128_8x2048x16
timeout 150 ncu --clock-control none --launch-count 1 -k regex:chunk_dplr_bwd_kernel --section SourceCounters --section WarpStateStats --import-source yes -o $OUT/tok python3 scripts/time_token_edits.py $U --shape 4x4096x32 > /tmp/ncu.log 2>&1; tail -3 /tmp/ncu.log
for ps in cuda sass; do timeout 60 ncu -i $OUT/tok.ncu-rep --page source --csv --print-source $ps > /tmp/src_$ps.csv 2>&1; echo "source $ps rc=$? $(wc -c < /tmp/src_$ps.csv)"; head -c 600 /tmp/src_$ps.csv; echo; done
(cd /tmp && tar czf $OUT/src.tgz src_*.csv)
(cd $OUT && tar czf te.tgz te_*.json && rm te_*.json)

#!/usr/bin/env bash
# session 10, GPU call 2: token-pass edits (shipped = capped at 168 now), other units capped vs not, ncu, prep cap A/B
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu2.log") 2>&1
G=generated/hopper
U=$G/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
python3 scripts/time_token_edits.py $U --shape 4x4096x32 --edits benchmarks/edits/token_edits_k64_b.json
mv $OUT/token_edits_4x4096x32.json $OUT/te_b_4x4096x32.json
python3 scripts/time_token_edits.py $U --shape 8x4096x64 --edits benchmarks/edits/token_edits_k64_b.json
mv $OUT/token_edits_8x4096x64.json $OUT/te_b_8x4096x64.json
for u in chunk_fp16_k64_v64_c16_dense_gbm0p61_gfp16_sfp32 chunk_bf16_k64_v64_c16_dense_gbm0p61_gfp32_sfp32 chunk_fp16_k64_v64_c16_dense_gbm0p61_gfp32_sfp32; do
  python3 scripts/time_token_edits.py $G/$u/sm_90.py --shape 4x4096x32 --edits benchmarks/edits/token_uncapped.json
  mv $OUT/token_edits_4x4096x32.json $OUT/te_$u.json
done
python3 scripts/time_token_edits.py $G/chunk_bf16_k64_v64_c16_dense_gany_gfp32_sfp32/sm_90.py --shape 4x4096x32 --edits benchmarks/edits/token_maxnreg168_any.json
mv $OUT/token_edits_4x4096x32.json $OUT/te_any.json
mkdir -p /tmp/te
timeout 120 ncu --clock-control none --launch-count 1 -k regex:chunk_dplr_bwd_kernel --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters python3 scripts/time_token_edits.py $U --shape 4x4096x32 > $OUT/ncu_token_k64.txt 2>&1
tail -5 $OUT/ncu_token_k64.txt
(cd $OUT && tar czf te.tgz te_*.json && rm te_*.json)
BUDGET=330 ROUNDS=2 scripts/gpu_time_packages.sh benchmarks/specs/regs_base.yaml benchmarks/specs/regs_prep168.yaml

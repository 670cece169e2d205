#!/usr/bin/env bash
# session 22, GPU call 27: ncu of the persistent token pass (the shipped unit's kernel at its persistent grid) at
# (4,4096,32,64) and of session 21's pass, for the next session
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
G=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
# launches of chunk_dplr_bwd_kernel in tok_persist_time.py with --rounds 0: 1 new (a program per item, for its
# resources), 2 old, 3 new at its persistent grid
for f in "old:1" "persistent:2"; do
  IFS=: read -r tag skip <<< "$f"
  timeout 200 ncu --clock-control none --launch-skip $skip --launch-count 1 -k regex:chunk_dplr_bwd_kernel \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    python3 $D/tok_persist_time.py $D/k64_shipped_unit.py $G --shapes 4x4096x32 --rounds 0 > $OUT/ncu_$tag.txt 2>&1
  echo "ncu $tag rc=$? $(grep -c . $OUT/ncu_$tag.txt) lines"
done
grep -h -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible|Grid Size|Registers Per|Shared Memory Config|L1/TEX Hit|L2 Hit" $OUT/ncu_old.txt $OUT/ncu_persistent.txt

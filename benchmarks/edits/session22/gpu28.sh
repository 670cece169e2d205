#!/usr/bin/env bash
# session 22, GPU call 28: ncu of the K = 128 token pass (Triton form, derived states) at (8,2048,16,128), for the
# next session: bound by DRAM or by latency?
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
D=benchmarks/edits/session22
G=generated/hopper/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
timeout 200 ncu --clock-control none --launch-count 1 -k regex:chunk_dplr_bwd_kernel \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section LaunchStats \
  python3 $D/run_units.py k128=$G --shapes 8x2048x16 --rounds 0 > $OUT/ncu_k128.txt 2>&1
echo "ncu rc=$? $(grep -c . $OUT/ncu_k128.txt) lines"
grep -h -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible|Grid Size|Registers Per|Dynamic Shared|Static Shared|L1/TEX Hit|L2 Hit" $OUT/ncu_k128.txt

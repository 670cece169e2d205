#!/usr/bin/env bash
# One GPU call (session 7): build specs/hopper.yaml and the candidate benchmarks/specs/token_chunk32.yaml,
# time both per stage (tune.py --package) and per op (bench.py), fla-best in the hopper run. fla's autotuning
# choices from an earlier call on the same machine type are restored first (scripts/gpu_setup.sh), so fla
# compiles only its chosen configs. Everything goes to $OUT (one log, the scripts' JSON and PNG). With the
# committed template the candidate's K=64 units are refused on sm_90 (docs/perf_notes.md 19): its K=128 ones
# still build and time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
T0=$(date +%s); LIMIT=${LIMIT:-470}
exec > >(tee -a "$OUT/gpu_token_chunk.log") 2>&1
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m dplr_gen.cli build benchmarks/specs/token_chunk32.yaml -j 6 > /tmp/b1.log 2>&1 &
BUILD_PID=$!
python3 -m dplr_gen.cli build specs/hopper.yaml -j 10
# wait for that build only: a bare `wait` also waits for the tee above (a process substitution), forever
# (that hang cost the 2026-11-23d call its time)
wait "$BUILD_PID"; tail -3 /tmp/b1.log
echo "== builds done at $(( $(date +%s) - T0 )) s"
SHAPES=4x4096x32x64,8x4096x64x64,8x2048x16x128,1x4096x2x128
python3 benchmarks/tune.py --package generated/hopper --dims 64,128 --chunks 16 --deadline $((T0 + LIMIT * 33 / 100)) | tail -8
python3 benchmarks/tune.py --package generated/token_chunk32 --dims 64,128 --chunks 16 --deadline $((T0 + LIMIT * 45 / 100)) | tail -8
python3 benchmarks/bench.py --package generated/token_chunk32 --systems dplr-fast,dplr-keep --shapes $SHAPES \
  --no-accuracy --deadline $((T0 + LIMIT * 6 / 10))
python3 benchmarks/bench.py --systems dplr-fast,dplr-keep,fla-best --shapes $SHAPES --no-accuracy --deadline $((T0 + LIMIT))
save_fla_autotune
echo "== done in $(( $(date +%s) - T0 )) s"; ls -la "$OUT"

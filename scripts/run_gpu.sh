#!/usr/bin/env bash
# One command on the GPU machine: install the carried wheels, build the hopper package, run the checks and/or
# the benchmark. Everything is logged to $OUT/run_gpu_<mode>.log; results land in $OUT (see the scripts).
#
#   scripts/run_gpu.sh check|bench|graphs|cold|model|examples|fla-tests|profile|streams|all [extra arguments for the script]
#
# profile: scripts/kernel_profile.py (GPU time per kernel, host time per call); streams: benchmarks/varlen_streams.py
# (the varlen backward's two stream choices against each other and fla-core); graphs: scripts/cuda_graph_check.py (every op form captured and replayed); cold: scripts/cold_start.py;
# model: scripts/fla_model_check.py (fla-core's RWKV-7 model with and without dplr_gen.integrations.fla);
# examples: examples/generate.py --verify, then on 2 or more GPUs examples/train_cp.py under torchrun;
# fla-tests: fla-core's op tests (one GPU) or its context-parallel tests (2 or more) with the imports swapped
# (scripts/fla_tests_swapped.sh; FLA_TESTS_DIR, default .peer/fla_tests/tests, is fla's tests/ folder).
# KERNEL_PACK: an archive of the Hopper spec's kernels built elsewhere (`dplr-gen build specs/hopper.yaml` then
# `dplr-gen pack specs/hopper.yaml -o FILE` on any machine with the same Triton, no GPU needed), carried with the
# tree: unpacked into the cache first, so the build below compiles nothing (seconds instead of minutes).
# bench runs the hand-written CUDA kernel beside the others where .peer/wind_rwkv holds its source
# (scripts/gpu_setup.sh).
#
# BUDGET (seconds, default 570) bounds the whole command, build included: the scripts get a deadline and write
# what they have by then. With `all`, the check gets half of what is left after the build, the bench the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
shift || true
case "$MODE" in check|bench|graphs|cold|model|examples|fla-tests|profile|streams|all) ;; *) echo "usage: $0 check|bench|graphs|cold|model|examples|fla-tests|profile|streams|all [args]" >&2; exit 2 ;; esac

START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-570}))
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_gpu_${MODE}.log") 2>&1
export PYTHONUNBUFFERED=1

echo "== $(date -Is) run_gpu.sh $MODE $*"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true

# the carried wheels; fla's autotune choices restored (scripts/gpu_setup.sh)
. scripts/gpu_setup.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import fla; print('fla-core importable')" 2>/dev/null || echo "fla-core NOT importable: fla systems will be recorded as unavailable"

[ "$MODE" = bench ] || [ "$MODE" = all ] && build_peer
if [ -n "${KERNEL_PACK:-}" ]; then python3 -m dplr_gen.cli unpack "$KERNEL_PACK"; fi
echo "== build specs/hopper.yaml"
t0=$(date +%s)
python3 -m dplr_gen.cli build specs/hopper.yaml -j 16
BUILD_RC=$?
echo "== build rc=$BUILD_RC in $(( $(date +%s) - t0 )) s"

now=$(date +%s)
case "$MODE" in
  check)
    python3 scripts/gpu_check.py --deadline "$DEADLINE" "$@" ;;
  bench)
    wait_peer
    python3 benchmarks/bench.py --deadline "$DEADLINE" "$@" ;;
  graphs)
    python3 scripts/cuda_graph_check.py "$@" ;;
  cold)
    python3 scripts/cold_start.py "$@" ;;
  profile)
    python3 scripts/kernel_profile.py "$@" ;;
  streams)
    python3 benchmarks/varlen_streams.py --budget $((DEADLINE - now - 30)) "$@" ;;
  model)
    python3 scripts/fla_model_check.py --deadline "$DEADLINE" "$@" ;;
  examples)
    python3 examples/generate.py --verify "$@"
    NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
    if [ "$NGPU" -ge 2 ]; then
      torchrun --standalone --nproc-per-node "$NGPU" examples/train_cp.py --save /tmp/train_cp.pt \
        && python3 examples/generate.py --checkpoint /tmp/train_cp.pt --verify "$@"
    else
      echo "examples/train_cp.py needs 2 or more GPUs: this machine has $NGPU"
    fi ;;
  fla-tests)
    NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
    if [ "$NGPU" -ge 2 ]; then which=cp; else which=ops; fi
    bash scripts/fla_tests_swapped.sh "$which" "${FLA_TESTS_DIR:-.peer/fla_tests/tests}" "$@" ;;
  all)
    python3 scripts/gpu_check.py --deadline $((now + (DEADLINE - now) / 2))
    python3 benchmarks/bench.py --deadline "$DEADLINE" ;;
esac
save_fla_autotune
echo "== done in $(( $(date +%s) - START )) s; outputs in $OUT:"
ls -la "$OUT"

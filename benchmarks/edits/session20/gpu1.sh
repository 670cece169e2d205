#!/usr/bin/env bash
# session 20, GPU call 1: the backward prep storing Q e^gamma and A_qk once, in the forward's layout (the reverse
# pass and the derived dS step read them through transposed offsets; the shared prep then adds only A_qb).
# Base: commit e05cde7's dplr_gen/templates/benchmarks unpacked in .exp/s20/base (package s19_base); candidate:
# the working tree (package s19_qwc); both one-variant-group packages whose sources equal generated/hopper's.
# 1. bit-for-bit outputs of both (run as benchmarks/edits/session20/dump_outputs.py, since moved to
# scripts/ab_outputs.py); 2. op level (bench.py, dplr-fast / dplr-keep, fla-best in the candidate's first
# round), alternating, two rounds; 3. per stage (tune.py --package) if time is left. Generalised, with a CPU
# dry run that the tests exercise: scripts/ab_base.sh and scripts/ab_gpu.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu1.log") 2>&1
T0=$(date +%s); END=$(( T0 + ${BUDGET:-540} ))
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
. scripts/gpu_setup.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
ROOT=$PWD; mkdir -p "$OUT/r"
run_in() { local dir=$1; shift; (cd "$dir" && PYTHONPATH="/tmp/site:$PWD" "$@"); }
left() { [ "$(date +%s)" -lt "$((END - $1))" ]; }
pkg() { [ "$1" = base ] && echo generated/s19_base || echo generated/s19_qwc; }
dir() { [ "$1" = base ] && echo "$ROOT/.exp/s20/base" || echo "$ROOT"; }
run_in .exp/s20/base python3 -m dplr_gen.cli build benchmarks/edits/session19/s19_base.yaml -j 8 > "$OUT/r/build_base.log" 2>&1 &
P1=$!
python3 -m dplr_gen.cli build benchmarks/edits/session19/s19_qwc.yaml -j 8 > "$OUT/r/build_qwc.log" 2>&1 &
P2=$!
wait $P1 $P2  # (a bare `wait` also waits for the tee above, forever)
echo "== builds done at $(( $(date +%s) - T0 )) s"; tail -n 3 "$OUT"/r/build_*.log
for x in base qwc; do
  run_in "$(dir $x)" timeout 90 python3 "$ROOT/scripts/ab_outputs.py" --package "$(pkg $x)" --out "/tmp/$x.pt"
done
python3 scripts/ab_outputs.py --compare /tmp/base.pt /tmp/qwc.pt 2>&1 | tail -n 20
echo "== equality done at $(( $(date +%s) - T0 )) s"
SHAPES=4x4096x32x64,8x4096x64x64,8x2048x16x128
for r in 1 2; do
  for x in base qwc; do
    left 60 || { echo "== budget spent"; break 2; }
    sys=dplr-fast,dplr-keep; [ $x = qwc ] && [ $r = 1 ] && sys=dplr-fast,dplr-keep,fla-best
    # (as run, a pattern substitution here recorded "e05cde7qwc+session20 qwc working tree"; corrected after)
    c=e05cde7; [ $x = qwc ] && c="e05cde7 + session 20 qw_once working tree"
    DPLR_GEN_COMMIT="$c" run_in "$(dir $x)" timeout 200 \
      python3 benchmarks/bench.py --package "$(pkg $x)" --systems $sys --shapes $SHAPES --no-accuracy --budget 190 2>&1 \
      | grep -E '^ *(4x|8x)|rror' | sed "s/^/$x r$r: /"
    for f in "$(dir $x)"/bench_*.json "$OUT"/bench_*.json; do [ -f "$f" ] && mv "$f" "$OUT/r/op_${x}_$r.json"; done
    for f in "$(dir $x)"/bench_*.png "$OUT"/bench_*.png; do [ -f "$f" ] && mv "$f" "$OUT/r/op_${x}_$r.png"; done
  done
done
echo "== op level done at $(( $(date +%s) - T0 )) s"
for r in 1 2; do
  for x in base qwc; do
    left 75 || { echo "== budget spent"; break 2; }
    run_in "$(dir $x)" timeout 70 python3 benchmarks/tune.py --package "$(pkg $x)" --chunks 16 --dims 64 --time-shape 8x4096x64 2>&1 | grep -E '^D=|FAIL|rror' | sed "s/^/$x r$r: /"
    for f in "$(dir $x)"/tune_*.json "$OUT"/tune_*.json; do [ -f "$f" ] && mv "$f" "$OUT/r/stage_${x}_8x4096x64_$r.json"; done
  done
done
(cd "$OUT/r" && tar czf "$OUT/s20_gpu1.tgz" .)
echo "== done at $(( $(date +%s) - T0 )) s"

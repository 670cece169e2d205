#!/usr/bin/env bash
# One GPU call: build several package specs, then time each package's kernels per stage (benchmarks/tune.py
# --package), in rounds that alternate over the packages, until the rounds or BUDGET seconds (default 500) run
# out. Results: $OUT/time_packages.tgz (time_<package>_<shape set>_<round>.json) and time_packages.log.
#   [TIME_SHAPES="default 8x4096x64"] [ROUNDS=2] scripts/gpu_time_packages.sh SPEC...
# TIME_SHAPES: "default" times D=64 at (4,4096,32) and D=128 at (8,2048,16) (tune.py's shapes); a BxTxH entry
# times D=64 at that shape.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/time_packages.log") 2>&1
END=$(( $(date +%s) + ${BUDGET:-500} ))
. scripts/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
pids=()
for spec in "$@"; do python3 -m dplr_gen.cli build "$spec" -j 4 > "/tmp/build_$(basename "$spec").log" 2>&1 & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done  # by PID: a bare `wait` would wait for the tee too
names=()
for spec in "$@"; do names+=("$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$spec")"); done
echo "== built ${names[*]}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for p in "${names[@]}"; do
    for shape in ${TIME_SHAPES:-default}; do
      [ "$(date +%s)" -lt "$END" ] || { echo "== budget spent"; break 3; }
      if [ "$shape" = default ]; then args=(--dims 64,128); else args=(--dims 64 --time-shape "$shape"); fi
      python3 benchmarks/tune.py --package "generated/$p" --chunks 16 "${args[@]}" | grep '^D=' | sed "s/^/$p $shape r$round: /"
      mv "$OUT"/tune_*.json "$OUT/time_${p}_${shape}_${round}.json" 2>/dev/null
    done
  done
done
(cd "$OUT" && tar czf time_packages.tgz time_*.json && rm -f time_*.json)
echo "== done"

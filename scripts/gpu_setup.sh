# Sourced (not run) by scripts/run_gpu.sh on the GPU machine, from the repository root:
#   * the wheels carried in .whl/ (pydantic, fla-core, ...) installed into /tmp/site, put on PYTHONPATH;
#   * fla-core's autotuning choices from an earlier run on this machine type restored into Triton's on-disk
#     autotune cache (on by default in fla; keyed by the Triton build, the GPU and the kernel's source, so a
#     stale entry is never used): fla then compiles only the configs it chose instead of autotuning for 5-10
#     minutes a shape. DPLR_BENCH_FLA_AUTOTUNE tells bench.py which archive (recorded in its JSON).
#   save_fla_autotune: the cache as it stands goes to $OUT/fla_autotune.tgz (commit it over the old archive
#   when it has grown).
#   * the hand-written CUDA kernel, a benchmark peer, where a checkout of github.com/johanwind/wind_rwkv was
#     carried in .peer/wind_rwkv (never part of this repository): DPLR_BENCH_WIND_DIR points at it, and
#     build_peer compiles its extensions (per head size, dense and varlen) in the background.
# (once per machine: a second run_gpu.sh started beside the first must not rewrite the files the first imports)
if compgen -G ".whl/*.whl" >/dev/null && [ ! -f /tmp/site/.wheels_installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.wheels_installed || echo "WARNING: wheel install failed"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

TRITON_CACHE="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
FLA_AUTOTUNE="${FLA_AUTOTUNE:-benchmarks/fla_autotune/h100_sm90_triton3.6.0_fla0.6.0.tgz}"
if [ -f "$FLA_AUTOTUNE" ]; then
  mkdir -p "$TRITON_CACHE" && tar xzf "$FLA_AUTOTUNE" -C "$TRITON_CACHE" \
    && export DPLR_BENCH_FLA_AUTOTUNE="$(realpath "$FLA_AUTOTUNE")" \
    && echo "restored fla's autotune choices from $FLA_AUTOTUNE"
  # (absolute: bench.py may run from another source tree's folder, where a relative path would not open)
fi

save_fla_autotune() {
  if [ -d "$TRITON_CACHE" ]; then
    (cd "$TRITON_CACHE" && find . -name '*.autotune.json' | tar czf "$OUT/fla_autotune.tgz" -T -)
  fi
}

if [ -d .peer/wind_rwkv/wind_rwkv ]; then
  export DPLR_BENCH_WIND_DIR="$PWD/.peer/wind_rwkv" TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}"
fi

PEER_PIDS=""
build_peer() {  # background compiles of the CUDA peer's extensions; wait_peer waits for them
  [ -n "${DPLR_BENCH_WIND_DIR:-}" ] || return 0
  for d in 64 128; do
    python3 -c "from benchmarks import common as C; C.load_wind($d, False); C.load_wind($d, True)" \
      > "$OUT/peer_build_d$d.log" 2>&1 &
    PEER_PIDS="$PEER_PIDS $!"
  done
}

wait_peer() {  # (a bare `wait` would also wait for the log's tee)
  for p in $PEER_PIDS; do wait "$p" || echo "the CUDA peer's build failed: $OUT/peer_build_*.log"; done
}

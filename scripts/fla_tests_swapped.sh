#!/usr/bin/env bash
# fla-core's own tests of the DPLR ops, run against dplr-gen as a user switching from fla would: the imports of
# chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule, chunk_rwkv7 and build_cp_context swapped to dplr_gen,
# nothing else changed (fla-core stays installed: the tests import its helpers and references). GPU machine, after
# `dplr-gen build`.
#
#   scripts/fla_tests_swapped.sh ops FLA_TESTS_DIR [pytest arguments]   # one GPU: tests/ops/
#   scripts/fla_tests_swapped.sh cp FLA_TESTS_DIR [pytest arguments]    # 2 or 4 GPUs: tests/context_parallel/
#
# FLA_TESTS_DIR is the tests/ folder of fla's repository; the files used are copied to a temporary folder and edited
# there, never into this repository. The cp tests spawn their ranks with torch.multiprocessing and pass the op to
# them as an argument (so the op must pickle); tests for fewer GPUs than the machine has run, the rest skip. fla's
# TileLang route test is left out: it asserts that fla's own TileLang backend ran.
set -euo pipefail
mode=${1:?usage: $0 ops|cp FLA_TESTS_DIR [pytest arguments]}; shift
src=${1:?usage: $0 ops|cp FLA_TESTS_DIR [pytest arguments]}; shift
case "$mode" in
  ops) files=("ops/test_dplr_delta.py" "ops/test_rwkv7.py"); expected=4
       tests=("test_dplr_delta.py::test_recurrent_fwd" "test_dplr_delta.py::test_fused_recurrent"
              "test_dplr_delta.py::test_chunk" "test_dplr_delta.py::test_chunk_safe_gate_multihead_gradients"
              "test_dplr_delta.py::test_chunk_varlen" "test_rwkv7.py::test_chunk_wrapper_chunk_size") ;;
  cp) files=("context_parallel/test_cp_dplr.py" "context_parallel/test_cp_rwkv7.py"); expected=3
      tests=("test_cp_dplr.py" "test_cp_rwkv7.py" "-k" "not tilelang") ;;
  *) echo "usage: $0 ops|cp FLA_TESTS_DIR [pytest arguments]" >&2; exit 2 ;;
esac
work=$(mktemp -d)
for f in "${files[@]}"; do cp "$src/$f" "$work/"; done
sed -i \
  -e 's/^from fla\.ops\.generalized_delta_rule\.dplr import chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule$/from dplr_gen import chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule/' \
  -e 's/^from fla\.ops\.generalized_delta_rule\.dplr import chunk_dplr_delta_rule$/from dplr_gen import chunk_dplr_delta_rule/' \
  -e 's/^from fla\.ops\.generalized_delta_rule\.dplr\.fused_recurrent import fused_recurrent_dplr_delta_rule$/from dplr_gen import fused_recurrent_dplr_delta_rule/' \
  -e 's/^from fla\.ops\.rwkv7 import chunk_rwkv7$/from dplr_gen import chunk_rwkv7/' \
  -e 's/^from fla\.ops\.cp import build_cp_context$/from dplr_gen.cp import build_cp_context/' \
  "$work"/*.py
# every swapped import must have matched: fla's files changed shape otherwise
n=$(cat "$work"/*.py | grep -c '^from dplr_gen[ .]' || true)
[ "$n" -eq "$expected" ] || { echo "expected $expected swapped imports, found $n: fla's test files changed" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$work"
# the spawned ranks import the test module by name from this folder (torch.multiprocessing pickles by reference)
PYTHONPATH="$work:$repo${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider "${tests[@]}" "$@"

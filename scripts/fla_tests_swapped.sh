#!/usr/bin/env bash
# fla-core's own tests of the DPLR ops, run against dplr-gen as a user switching from fla would: the imports of
# chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule and chunk_rwkv7 swapped to dplr_gen, nothing else changed
# (fla-core stays installed: the tests import its helpers and references). GPU machine, after `dplr-gen build`.
#
#   scripts/fla_tests_swapped.sh FLA_TESTS_DIR [pytest arguments]
#
# FLA_TESTS_DIR holds test_dplr_delta.py and test_rwkv7.py from fla's repository (tests/ops/); they are copied to a
# temporary folder and edited there, never into this repository.
set -euo pipefail
src=${1:?usage: $0 FLA_TESTS_DIR [pytest arguments]}; shift
work=$(mktemp -d)
cp "$src/test_dplr_delta.py" "$src/test_rwkv7.py" "$work/"
sed -i \
  -e 's/^from fla\.ops\.generalized_delta_rule\.dplr import chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule$/from dplr_gen import chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule/' \
  -e 's/^from fla\.ops\.generalized_delta_rule\.dplr import chunk_dplr_delta_rule$/from dplr_gen import chunk_dplr_delta_rule/' \
  -e 's/^from fla\.ops\.generalized_delta_rule\.dplr\.fused_recurrent import fused_recurrent_dplr_delta_rule$/from dplr_gen import fused_recurrent_dplr_delta_rule/' \
  -e 's/^from fla\.ops\.rwkv7 import chunk_rwkv7$/from dplr_gen import chunk_rwkv7/' \
  "$work/test_dplr_delta.py" "$work/test_rwkv7.py"
# every swapped import must have matched: fla's file changed shape otherwise
n=$(grep -c '^from dplr_gen import' "$work/test_dplr_delta.py" "$work/test_rwkv7.py" | awk -F: '{s += $2} END {print s}')
[ "$n" -eq 4 ] || { echo "expected 4 swapped imports, found $n: fla's test files changed" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$work"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider \
  "test_dplr_delta.py::test_recurrent_fwd" "test_dplr_delta.py::test_fused_recurrent" \
  "test_dplr_delta.py::test_chunk" "test_dplr_delta.py::test_chunk_safe_gate_multihead_gradients" \
  "test_dplr_delta.py::test_chunk_varlen" "test_rwkv7.py::test_chunk_wrapper_chunk_size" "$@"

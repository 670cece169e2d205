#!/usr/bin/env bash
# session 21, GPU call 9: the Gluon token pass in the lean order (tok_gluon5.py: 188 bytes spilled at 168 registers
# against 404 for the shipped order), uncapped and at 168 (3 programs an SM) / 184, against the shipped kernel.
set -uo pipefail
export PYTHONUNBUFFERED=1
. scripts/gpu_setup.sh > /dev/null
U=generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py
D=benchmarks/edits/session21
timeout 150 python3 $D/run_tok.py $U $D/tok_gluon5.py --shapes "2x1000x4,8x4096x64" --rounds 2 \
  --forms "lean5:token_pass_lean5:4:0,lean5c168:token_pass_lean5:4:168,lean5c184:token_pass_lean5:4:184" 2>&1 | grep -v '^2x1000\|^8x4096x64 [a-z0-9]*: {' | tee $OUT/gpu9.log
python3 -c "
import json
for r in json.load(open('$OUT/gluon_token.json'))['rows']:
    if r.get('vs_shipped'): print(r['shape'], r['form'], {k: ('%.1e' % v['rel_norm'], v['nan']) for k, v in r['vs_shipped'].items()})
"

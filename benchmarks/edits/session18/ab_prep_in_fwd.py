"""Session 18 A/B: dplr-keep (disable_recompute=True) with the forward running the backward's prep (ops.PREP_IN_FORWARD
True) against the forward and backward each running their own (False), alternating rounds, same inputs; dplr-fast
once per round for reference. Also checks that o, ht and every gradient are bit-identical between the two keep forms
and equal dplr-fast's (as before), and records peak memory.

    python benchmarks/edits/session18/ab_prep_in_fwd.py PACKAGE OUT.json [rounds]
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402

from benchmarks import common as C  # noqa: E402
from dplr_gen import ops  # noqa: E402

pkg, out = sys.argv[1], Path(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
dev = torch.device("cuda")
shapes = [(8, 4096, 64, 64), (8, 2048, 16, 128), (4, 4096, 32, 64)]
keep, _ = C.load_op(C.SYSTEMS["dplr-keep"], pkg)
fast, _ = C.load_op(C.SYSTEMS["dplr-fast"], pkg)
res = {"machine": C.machine_info(), "rows": []}
for B, T, H, D in shapes:
    x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device=dev, seed=1)
    do, dht = C.grad_outputs(x, 7)
    xl = C.leaves(x)
    got = {}
    for form, op, flag in (("keep-own-prep", keep, False), ("keep-prep-in-fwd", keep, True), ("fast", fast, True)):
        ops.PREP_IN_FORWARD = flag
        got[form] = C.fwd_bwd(op, xl, do, dht)
    same = {f: all(torch.equal(got["keep-own-prep"][n], got[f][n]) for n in got[f])
            for f in ("keep-prep-in-fwd", "fast")}
    diff = {n: (got["keep-own-prep"][n].float() - got["keep-prep-in-fwd"][n].float()).abs().max().item()
            for n in got["fast"]}
    del got
    row = {"shape": [B, T, H, D], "bit_identical_to_keep_own_prep": same, "max_abs_diff_prep_in_fwd": diff,
           "ms": {}}
    for r in range(rounds):
        for form, op, flag in (("keep-own-prep", keep, False), ("keep-prep-in-fwd", keep, True), ("fast", fast, True)):
            ops.PREP_IN_FORWARD = flag
            f, fb = C.step_closures(op, xl, do, dht)
            row["ms"].setdefault(form, []).append({"fwd": C.bench_ms(f, dev), "fwd_bwd": C.bench_ms(fb, dev)})
            if r == 0:
                row.setdefault("peak_bytes", {})[form] = C.peak_bytes(fb, dev)
            print(B, T, H, D, form, f"r{r + 1}", row["ms"][form][-1], flush=True)
    print(B, T, H, D, "same:", same, "peak:", row["peak_bytes"], flush=True)
    res["rows"].append(row)
    del x, xl, do, dht
    C.free(dev)
ops.PREP_IN_FORWARD = True
C.write_json(out, res)

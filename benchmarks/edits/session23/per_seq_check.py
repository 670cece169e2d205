"""The shipped varlen backward with its token pass launched per sequence (chunk_driver.per_sequence_launches)
against the varlen kernel (PER_SEQUENCE off), through the public op: every gradient bit for bit, NaN-poisoned
buffers; which path the rule takes by itself; and the op's time both ways. (GPU machine)

    python benchmarks/edits/session23/per_seq_check.py
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmarks import bench, common as C  # noqa: E402


def main() -> int:
    import torch
    import triton

    from dplr_gen import chunk_driver

    op, _ = C.load_op(C.SYSTEMS["dplr-fast"], str(REPO / "generated" / "hopper"))
    cases = {"bench_varlen": (list(bench.VARLEN.lengths), 32, 64),
             "bench_varlen_d128_h16": ([n // 2 for n in bench.VARLEN.lengths], 16, 128),
             "short_and_long_forced": ([1, 5, 700, 16, 17, 3000, 33], 8, 64)}
    taken = []
    real = chunk_driver.per_sequence_launches
    chunk_driver.per_sequence_launches = lambda *a: taken.append(r := real(*a)) or r
    res = {}
    try:
        for name, (lens, H, D) in cases.items():
            s = C.Shape(1, sum(lens), H, D, tuple(lens))
            x = C.rwkv7_case(s.B, s.T, s.H, s.D, dtype=torch.bfloat16, device="cuda", seed=11, n_states=s.N)
            do, dht = C.grad_outputs(x, 11)
            cu, cu_cpu = C.cu_tensors(s.lengths, "int32", "cuda")
            row = {"lengths": lens, "H": H, "D": D}
            grads = {}
            for mode in (None, False, True):
                if name.endswith("forced") and mode is None:
                    continue
                chunk_driver.PER_SEQUENCE = mode
                chunk_driver.POISON = True
                taken.clear()
                try:
                    grads[mode] = C.fwd_bwd(op, C.leaves(x), do, dht, cu, cu_cpu)
                    torch.cuda.synchronize()
                finally:
                    chunk_driver.POISON = False
                row[f"per_sequence_taken[{mode}]"] = bool(taken and taken[-1] is not None)
                _, step = C.step_closures(op, C.leaves(x), do, dht, cu, cu_cpu)
                row[f"fwd_bwd_ms[{mode}]"] = round(triton.testing.do_bench(step, warmup=25, rep=200), 4)
            ref = grads[False]
            for mode, g in grads.items():
                row[f"bit_equal[{mode}]"] = all(torch.equal(g[k], ref[k]) for k in ref)
                row[f"nan[{mode}]"] = sum(int(g[k].isnan().sum()) for k in ref)
            res[name] = row
            print(name, json.dumps(row), flush=True)
    finally:
        chunk_driver.per_sequence_launches = real
        chunk_driver.PER_SEQUENCE = None
    ok = all(v for r in res.values() for k, v in r.items() if k.startswith("bit_equal")) and \
        all(v == 0 for r in res.values() for k, v in r.items() if k.startswith("nan"))
    print("ALL BIT-EQUAL" if ok else "MISMATCH")
    (Path(os.environ.get("OUT", ".")) / "per_seq_check.json").write_text(json.dumps({
        "what": __doc__.splitlines()[0], "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "ok": ok, "rows": res}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

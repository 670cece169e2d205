"""Varlen forward+backward (the bench's case) and its 16-sequence dense twin, A/B in one process (GPU machine):
the slot maps from chunk_driver.slot_map (host build, cached) against a device build every call (the code before
session 23), and the states pass beside the reverse pass forced on / off / by the driver. Interleaved rounds.

    python benchmarks/edits/session23/varlen_ab.py [--rounds 3]
"""
from __future__ import annotations

import argparse
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

    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    op, _ = C.load_op(C.SYSTEMS["dplr-fast"], args.package)
    real_slot_map = chunk_driver.slot_map

    def device_every_call(cu, C_, n_slots, offsets=None):
        return chunk_driver.chunk_map_from_cu_seqlens(cu, C_, n_slots)

    cases = {}
    for s in (bench.VARLEN, bench.DENSE_BATCH):
        x = C.rwkv7_case(s.B, s.T, s.H, s.D, dtype=torch.bfloat16, device="cuda", seed=3,
                         n_states=s.N if s.lengths else None)
        do, dht = C.grad_outputs(x, 3)
        cu, cu_cpu = C.cu_tensors(s.lengths, "int32", "cuda")
        cases[s.label] = (s, x, do, dht, cu, cu_cpu)
    forms = {"slot_map": (real_slot_map, None), "device_map": (device_every_call, None),
             "slot_map_overlap_on": (real_slot_map, True), "slot_map_overlap_off": (real_slot_map, False)}
    res: dict = {}
    ref: dict = {}
    for rnd in range(args.rounds):
        for label, (s, x, do, dht, cu, cu_cpu) in cases.items():
            for form, (sm, ov) in forms.items():
                if s.lengths is None and form in ("device_map",):
                    continue
                chunk_driver.slot_map = sm
                chunk_driver.OVERLAP = ov
                try:
                    xl = C.leaves(x)
                    fwd, step = C.step_closures(op, xl, do, dht, cu, cu_cpu)
                    g = step()
                    torch.cuda.synchronize()
                    if rnd == 0:  # every form's gradients equal the first form's
                        got = [t.float() for t in g]
                        if label not in ref:
                            ref[label] = got
                        diff = max((a - b).abs().max().item() for a, b in zip(got, ref[label]))
                        res.setdefault(label, {}).setdefault(form, {})["max_abs_diff_vs_first"] = diff
                    ms_f = triton.testing.do_bench(fwd, warmup=25, rep=200)
                    ms = triton.testing.do_bench(step, warmup=25, rep=200)
                finally:
                    chunk_driver.slot_map = real_slot_map
                    chunk_driver.OVERLAP = None
                r = res.setdefault(label, {}).setdefault(form, {})
                r.setdefault("fwd_ms", []).append(round(ms_f, 4))
                r.setdefault("fwd_bwd_ms", []).append(round(ms, 4))
                print(rnd, label, form, f"fwd {ms_f:.4f} fwd+bwd {ms:.4f} ms", flush=True)
    out = {"what": __doc__.splitlines()[0], "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "varlen_lengths": list(bench.VARLEN.lengths), "rows": res}
    (Path(os.environ.get("OUT", ".")) / "varlen_ab.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

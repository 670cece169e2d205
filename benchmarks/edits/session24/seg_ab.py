"""The small-grid forward over segments (knob chunk.fwd_small.segments) against one walk per sequence, same
package and inputs, rounds alternating: forward and forward+backward medians (do_bench), each kernel's GPU
time, and the errors of both against float64. (GPU machine)

    python benchmarks/edits/session24/seg_ab.py [--package generated/hopper] [--shapes 1x4096x2x128,...]
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

from benchmarks import common as C  # noqa: E402
sys.path.insert(0, str(REPO / "benchmarks" / "edits" / "session23"))
from varlen_order import kernel_times  # noqa: E402

from dplr_gen import chunk_driver  # noqa: E402

SHAPES = "1x4096x2x128,1x8192x2x128,2x2048x8x128,1x16384x4x128,4x2048x8x128,8x2048x16x128"
# None: the rule (chunk_driver.segments); 0: one walk; n: n segments forced
MODES = {"one_walk": 0, "rule": None}


def main() -> int:
    import torch
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--forced", default="4,16", help="segment counts forced at the first shape")
    ap.add_argument("--accuracy", default="1x4096x2x128,2x2048x8x128")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    ops = {s: C.load_op(C.SYSTEMS[s], args.package)[0] for s in ("dplr-fast", "dplr-keep")}
    res: dict = {"what": __doc__.splitlines()[0], "machine": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                 "rows": {}}
    shapes = args.shapes.split(",")
    for i, shape in enumerate(shapes):
        B, T, H, D = (int(v) for v in shape.split("x"))
        x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=7)
        do, dht = C.grad_outputs(x, 7)
        modes = dict(MODES)
        if i == 0 or shape in args.accuracy.split(","):
            modes.update({f"forced_{n}": int(n) for n in args.forced.split(",") if n})
        row = res["rows"].setdefault(shape, {})
        for gates in (("random", "slow") if shape in args.accuracy.split(",") else ()):
            xa = dict(x)
            if gates == "slow":  # a quarter of the channels nearly without decay: the maps' P far from 0
                xa["w"] = x["w"].clone()
                xa["w"][..., : D // 4] *= 0.002
            ref = C.reference(xa, do, dht)
            first = None
            for system, op in ops.items():
                for mode, n in modes.items():
                    chunk_driver.SEGMENTS = n
                    calls = []
                    rule = chunk_driver.segments
                    chunk_driver.segments = lambda *a: calls.append(rule(*a)) or calls[-1]
                    try:
                        got = C.fwd_bwd(op, C.leaves(xa), do, dht)
                    finally:
                        chunk_driver.segments = rule
                    first = first or got
                    row.setdefault("errors", {})[f"{gates}:{system}:{mode}"] = {
                        **C.errors(got, ref), "segments": calls,
                        "o_max_abs_diff_vs_first": (got["o"].float() - first["o"].float()).abs().max().item()}
            del ref
        for rnd in range(args.rounds):
            for mode, n in modes.items():
                chunk_driver.SEGMENTS = n
                fwd, step = C.step_closures(ops["dplr-fast"], C.leaves(x), do, dht)
                r = row.setdefault(mode, {})
                if rnd == 0:
                    r["fwd_kernel_us"] = kernel_times(fwd)
                    r["fwd_bwd_kernel_us"] = kernel_times(step)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(200):
                        fwd()
                    r["fwd_host_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
                    torch.cuda.synchronize()
                r.setdefault("fwd_ms", []).append(round(triton.testing.do_bench(fwd, warmup=50, rep=300), 4))
                r.setdefault("fwd_bwd_ms", []).append(round(triton.testing.do_bench(step, warmup=50, rep=300), 4))
                print(shape, rnd, mode, r["fwd_ms"][-1], r["fwd_bwd_ms"][-1],
                      (r["fwd_kernel_us"], r["fwd_host_us"], r["fwd_bwd_kernel_us"]) if rnd == 0 else "", flush=True)
        chunk_driver.SEGMENTS = None
        (out / "seg_ab.json").write_text(json.dumps(res, indent=1))
    for s, r in res["rows"].items():
        for k, e in r.get("errors", {}).items():
            print(s, k, {n: (round(v, 6) if isinstance(v, float) else v) for n, v in e.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

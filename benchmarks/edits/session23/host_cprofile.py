"""Where the host's time goes in one dplr-fast forward+backward at a host-bound shape (GPU machine): cProfile
of N calls issued back to back (the GPU is synchronised once at the end), top functions by own time and by
cumulative time.

    python benchmarks/edits/session23/host_cprofile.py [--shape 1x4096x2x128] [--calls 200]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmarks import common as C  # noqa: E402


def main() -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1x4096x2x128")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    args = ap.parse_args()
    op, _ = C.load_op(C.SYSTEMS["dplr-fast"], args.package)
    B, T, H, D = (int(v) for v in args.shape.split("x"))
    x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=5)
    do, dht = C.grad_outputs(x, 5)
    fwd, step = C.step_closures(op, C.leaves(x), do, dht)
    out = []
    for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls * 1e3
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        out.append(f"== {name}: host {host:.4f} ms per call (no profiler)\n" + s.getvalue())
        print(out[-1][:200], flush=True)
    Path(os.environ.get("OUT", "."), f"host_cprofile_{args.shape}.txt").write_text("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

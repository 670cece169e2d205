"""Forward and forward+backward of dplr-fast at a small-grid shape (default (1, 4096, 2, 128)) from several
one-variant packages, rounds alternating over the packages, each kernel's GPU time from torch.profiler, the
gradients compared with the first package's. (GPU machine)

    python benchmarks/edits/session23/small_sweep.py generated/s23_small_a generated/s23_small_b ... [--shape ..]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from varlen_order import kernel_times  # noqa: E402


def main() -> int:
    import torch
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("packages", nargs="+")
    ap.add_argument("--shape", default="1x4096x2x128")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    B, T, H, D = (int(v) for v in args.shape.split("x"))
    x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=5)
    do, dht = C.grad_outputs(x, 5)
    ops = {p: C.load_op(C.SYSTEMS["dplr-fast"], p)[0] for p in args.packages}
    res: dict = {}
    ref = None
    for rnd in range(args.rounds):
        for p, op in ops.items():
            fwd, step = C.step_closures(op, C.leaves(x), do, dht)
            if rnd == 0:
                g = [t.float() for t in step()]
                ref = ref or g
                res.setdefault(p, {})["max_abs_diff_vs_first"] = max((a - b).abs().max().item() for a, b in zip(g, ref))
                # relative norm difference (another chunk size rounds differently)
                res[p]["rel_diff_vs_first"] = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                                                  for a, b in zip(g, ref))
                res[p]["kernel_us"] = kernel_times(step)
            r = res.setdefault(p, {})
            r.setdefault("fwd_ms", []).append(round(triton.testing.do_bench(fwd, warmup=25, rep=200), 4))
            r.setdefault("fwd_bwd_ms", []).append(round(triton.testing.do_bench(step, warmup=25, rep=200), 4))
            print(rnd, p, r["fwd_ms"][-1], r["fwd_bwd_ms"][-1], r["kernel_us"] if rnd == 0 else "", flush=True)
    (Path(os.environ.get("OUT", ".")) / f"small_sweep_{args.shape}.json").write_text(json.dumps({
        "what": __doc__.splitlines()[0], "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "shape": [B, T, H, D],
        "rows": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

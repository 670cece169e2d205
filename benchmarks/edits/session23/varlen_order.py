"""The bench's varlen case with its 16 sequences in other orders (the same lengths): does the order of the
sequences, i.e. which state-pass programs share an SM, change the passes' time? (GPU machine)

    python benchmarks/edits/session23/varlen_order.py [--rounds 2]
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


def kernel_times(fn) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            out[e.key[:40]] = round(e.self_device_time_total / 3, 1)  # us per call
    return out


def main() -> int:
    import torch
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    op, _ = C.load_op(C.SYSTEMS["dplr-fast"], args.package)
    base = list(bench.VARLEN.lengths)
    desc = sorted(base, reverse=True)
    orders = {"bench": base, "desc": desc, "asc": desc[::-1],
              "long_short": [v for pair in zip(desc[:8], desc[::-1][:8]) for v in pair]}
    res: dict = {}
    for rnd in range(args.rounds):
        for name, lens in orders.items():
            s = C.Shape(1, sum(lens), bench.VARLEN.H, bench.VARLEN.D, tuple(lens))
            x = C.rwkv7_case(s.B, s.T, s.H, s.D, dtype=torch.bfloat16, device="cuda", seed=3, n_states=s.N)
            do, dht = C.grad_outputs(x, 3)
            cu, cu_cpu = C.cu_tensors(s.lengths, "int32", "cuda")
            fwd, step = C.step_closures(op, C.leaves(x), do, dht, cu, cu_cpu)
            step()
            torch.cuda.synchronize()
            ms_f = triton.testing.do_bench(fwd, warmup=25, rep=200)
            ms = triton.testing.do_bench(step, warmup=25, rep=200)
            r = res.setdefault(name, {"lengths": lens})
            r.setdefault("fwd_ms", []).append(round(ms_f, 4))
            r.setdefault("fwd_bwd_ms", []).append(round(ms, 4))
            if rnd == 0:
                r["kernel_us"] = kernel_times(step)
            print(rnd, name, f"fwd {ms_f:.4f} fwd+bwd {ms:.4f} ms", r.get("kernel_us") if rnd == 0 else "",
                  flush=True)
            del x, do, dht
    out = {"what": __doc__.splitlines()[0], "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "rows": res}
    (Path(os.environ.get("OUT", ".")) / "varlen_order.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

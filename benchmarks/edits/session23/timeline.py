"""Every kernel of one dplr-fast forward+backward, in launch order, with its GPU time and the gaps between
(torch.profiler trace), at the bench's shapes: where the remaining targets' time goes (GPU machine).

    python benchmarks/edits/session23/timeline.py [--shapes 8x2048x16x128,varlen,...] [--package generated/hopper]
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
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    ap.add_argument("--shapes", default="8x2048x16x128,varlen,16x2048x32x64,1x4096x2x128")
    ap.add_argument("--system", default="dplr-fast")
    args = ap.parse_args()
    op, _ = C.load_op(C.SYSTEMS[args.system], args.package)
    out = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "system": args.system, "date": time.strftime("%Y-%m-%d %H:%M"), "rows": {}}
    for text in args.shapes.split(","):
        s = C.parse_shape(text, bench.PRESETS)
        x = C.rwkv7_case(s.B, s.T, s.H, s.D, dtype=torch.bfloat16, device="cuda", seed=3,
                         n_states=s.N if s.lengths else None)
        do, dht = C.grad_outputs(x, 3)
        cu, cu_cpu = C.cu_tensors(s.lengths, "int32", "cuda")
        fwd, step = C.step_closures(op, C.leaves(x), do, dht, cu, cu_cpu)
        row = {}
        for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                         key=lambda e: e.time_range.start)
            # the last of the three calls: from its first kernel (same name as the trace's first) on
            first = evs[0].name
            starts = [i for i, e in enumerate(evs) if e.name == first]
            last = evs[starts[-1]:] if len(starts) >= 3 else evs
            t_begin = last[0].time_range.start
            ks = [{"name": e.name[:60], "start_us": round(e.time_range.start - t_begin, 1),
                   "us": round(e.time_range.end - e.time_range.start, 1)} for e in last]
            span = last[-1].time_range.end - t_begin
            busy = sum(k["us"] for k in ks)
            row[name] = {"do_bench_ms": round(ms, 4), "span_us": round(span, 1), "kernel_us": round(busy, 1),
                         "kernels": ks}
            print(text, name, f"do_bench {ms:.3f} ms, span {span:.0f} us, kernels {busy:.0f} us", flush=True)
            for k in ks:
                print(f"   {k['start_us']:9.1f} {k['us']:8.1f}  {k['name']}")
        out["rows"][text] = row
        del x, do, dht
        torch.cuda.empty_cache()
    dst = Path(os.environ.get("OUT", ".")) / "timeline.json"
    dst.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a forward+backward's time goes at a small, host-bound shape (GPU machine): GPU time per kernel against
the host's time per call, with the backward's states pass beside the reverse pass forced off and on.

    python scripts/host_profile.py [--shape 1x4096x2x128] [--package generated/hopper]

Per setting: do_bench of forward+backward (what benchmarks/bench.py reports), the host's wall time per call when
calls are issued back to back without synchronising (the rate at which Python and the launches can feed the GPU),
and one call under torch.profiler: every CUDA kernel's duration and the host time of the whole call. Writes
host_profile_<shape>.json to $OUT (or the working directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common as C  # noqa: E402


def main() -> int:
    import torch
    import triton
    from torch.profiler import ProfilerActivity, profile

    from dplr_gen import chunk_driver

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=str(C.REPO / "generated" / "hopper"))
    ap.add_argument("--shape", default="1x4096x2x128")
    args = ap.parse_args()
    op, _ = C.load_op(C.SYSTEMS["dplr-fast"], args.package)
    B, T, H, D = (int(v) for v in args.shape.split("x"))
    x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=5)
    do, dht = C.grad_outputs(x, 5)
    _, step = C.step_closures(op, C.leaves(x), do, dht)

    rows = {}
    try:
        for label, mode in {"overlap_off": False, "overlap_on": True, "driver": None}.items():
            chunk_driver.OVERLAP = mode
            step()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, warmup=25, rep=200)
            torch.cuda.synchronize()
            n = 50
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            host_ms = (time.perf_counter() - t0) / n * 1e3  # issue rate: the GPU may still be busy after
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            kernels = {}
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
                    kernels[e.key] = round(e.self_device_time_total / 1e3, 4)
            rows[label] = {"do_bench_ms": round(ms, 4), "host_ms_per_call": round(host_ms, 4),
                           "gpu_kernel_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
                           "gpu_kernel_ms_sum": round(sum(kernels.values()), 4)}
            print(label, json.dumps(rows[label]), flush=True)
    finally:
        chunk_driver.OVERLAP = None
    out = Path(os.environ.get("OUT", "."))
    (out / f"host_profile_{args.shape}.json").write_text(json.dumps({
        "what": __doc__.splitlines()[0], "shape": [B, T, H, D], "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "package": args.package,
        "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One forward + backward of the shipped chunk op for a profiler to watch (GPU machine).

    ncu -k regex:chunk_dplr --section SpeedOfLight ... python scripts/profile_once.py [--shape 4x4096x32x64]

Runs the op once untimed (loads and launches every kernel), then once more under a CUDA profiler range, so a
profiler can capture just the second pass (`--profile-from-start off` with ncu/nsys).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import torch

    import dplr_gen
    from benchmarks import common as C
    from dplr_gen.testing import rwkv7_inputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x4096x32x64")
    args = ap.parse_args()
    s = C.parse_shape(args.shape, {})
    x = {n: t.requires_grad_(True) for n, t in
         rwkv7_inputs(s.B, s.T, s.H, s.D, dtype=torch.bfloat16, device="cuda", seed=0).items()}
    for profiled in (False, True):
        if profiled:
            torch.cuda.cudart().cudaProfilerStart()
        o, ht = dplr_gen.chunk_dplr_delta_rule(**x, output_final_state=True, lower_bound=-0.61)
        ((o.float() * o.detach().float()).sum() + (ht * ht.detach()).sum()).backward()
        torch.cuda.synchronize()
        if profiled:
            torch.cuda.cudart().cudaProfilerStop()
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

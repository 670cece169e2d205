"""The backward's states pass beside the reverse pass (knob chunk.bwd_dh.overlap): forward and forward+backward
times with it forced off, forced on, and as the driver chooses (the knob and whether both grids fit on the device
at once), same inputs, same process, one GPU. Writes overlap_ab.json to $OUT (or the working directory).

    python benchmarks/overlap_ab.py [--package generated/hopper] [--shapes 4x4096x64x64,...]
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

SHAPES = "2x4096x32x64,4x4096x32x64,4x4096x64x64,8x4096x64x64,4x4096x16x128,8x2048x16x128,1x32768x32x64"


def main() -> int:
    import torch
    import triton

    from dplr_gen import chunk_driver

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=str(C.REPO / "generated" / "hopper"))
    ap.add_argument("--shapes", default=SHAPES)
    args = ap.parse_args()
    op, _ = C.load_op(C.SYSTEMS["dplr-fast"], args.package)
    # label -> chunk_driver.OVERLAP (None: the driver's own choice)
    settings = {"off": False, "on": True, "driver": None, "off_again": False}
    rows = []
    for spec in args.shapes.split(","):
        B, T, H, D = (int(x) for x in spec.split("x"))
        x = C.rwkv7_case(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=5)
        do, dht = C.grad_outputs(x, 5)
        fwd, step = C.step_closures(op, C.leaves(x), do, dht)

        row = {"shape": [B, T, H, D], "driver_picks_overlap": C.overlap_picked(args.package, x)}
        try:
            for label, mode in settings.items():
                chunk_driver.OVERLAP = mode
                step()
                row[f"{label}_fwd_ms"] = triton.testing.do_bench(fwd, warmup=25, rep=100)
                torch.cuda.reset_peak_memory_stats()
                row[f"{label}_ms"] = triton.testing.do_bench(step, warmup=25, rep=100)
                row[f"{label}_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        finally:
            chunk_driver.OVERLAP = None
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x, do, dht, fwd, step
    out = Path(os.environ.get("OUT", "."))
    res = {"what": __doc__.splitlines()[0], "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "package": args.package, "dtype": "bf16", "gate_bound": C.GATE_BOUND,
           "settings": {k: {"OVERLAP": o} for k, o in settings.items()},
           "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    (out / "overlap_ab.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

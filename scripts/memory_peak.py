"""Where a forward+backward's peak memory goes, counted on the CPU at the bench's shapes: no GPU, no kernel run.

    python scripts/memory_peak.py [--shapes 4x4096x32x64,...] [--package generated/hopper] [--bounds -0.61,none]

The op runs as the bench calls it (bf16 RWKV-7 inputs, a random initial state, output_final_state=True, gradients
of every input and h0 by torch.autograd.grad) under Triton's interpreter with every kernel launch skipped
(chunk_driver.DriverOptions.launch): the driver allocates and frees its buffers as in a real call and nothing is
computed, so any shape counts in seconds. Each buffer the driver allocates is followed from its allocation until
it is freed; the peak is the largest total alive at once. Per case:
  peak_bytes      the driver's buffers alive at the peak (o and the gradients included, the inputs and the
                  cotangents not: what the bench's peak GB counts, less the op's few small tensors);
  peak_x          the same in X, one [B, T, H, K] tensor of the input dtype;
  at_peak         those buffers, largest first: bytes, shape, dtype and the driver function that allocated each;
  allocations     how many buffers the call allocated.
Each case counts in both orders of the backward's passes (--orders): one_stream, the reverse pass first (a GPU
runs it so where the two grids do not fit at once, and for host-bound shapes), and side_by_side, the states pass
beside the reverse pass (a GPU runs it so where both fit, chunk_driver._overlap: the reverse pass's operands are
then alive beside h and U); on the CPU the second is the same buffers, one pass after the other. Writes
$OUT/memory_peak_<package folder name>.json (./ without $OUT).
--dry-run: tiny shapes, the Hopper spec rendered into a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench as BENCH  # noqa: E402
from benchmarks import common as C  # noqa: E402

DRIVER_FILE = "chunk_driver.py"
ALLOCATORS = ("_empty", "_empty_parts")  # the driver's allocation helpers: the function that called them is named


class Tracker:
    """The driver's buffers alive at each moment, and the largest such set (its allocation callback)."""

    def __init__(self) -> None:
        self.live: dict[int, dict[str, Any]] = {}
        self.total = 0
        self.peak = 0
        self.at_peak: list[dict[str, Any]] = []
        self.count = 0

    def __call__(self, t: Any) -> None:
        nbytes = t.numel() * t.element_size()
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.endswith(DRIVER_FILE) and f.name not in ALLOCATORS]
        record = {"bytes": nbytes, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                  "allocated_by": frames[-1].name if frames else "?"}
        key = id(t)
        self.live[key] = record
        self.total += nbytes
        self.count += 1
        # (a view's base is kept alive by the view: the whole allocation counts until its last view is gone)
        weakref.finalize(t, self._free, key, nbytes)
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = sorted(self.live.values(), key=lambda r: -r["bytes"])

    def _free(self, key: int, nbytes: int) -> None:
        if self.live.pop(key, None) is not None:
            self.total -= nbytes


ORDERS = {"one_stream": False, "side_by_side": True}  # -> DriverOptions.overlap


def count(package: str, shape: C.Shape, bound: float | None, order: str = "one_stream", dtype: str = "bfloat16",
          launch: bool = False) -> dict[str, Any]:
    """One case's count (the fields above) in the backward's ``order`` (ORDERS). ``launch``: run the kernels
    too (Triton's interpreter: tiny shapes only; a bf16 call then runs the fp32 variant, as every bf16 call on
    the CPU does)."""
    import torch

    from dplr_gen.runtime import chunk_driver, ops
    from dplr_gen.runtime.loader import package_at

    x = C.rwkv7_case(shape.B, shape.T, shape.H, shape.D, dtype=getattr(torch, dtype), device="cpu", seed=0,
                     n_states=shape.N)
    do, dht = C.grad_outputs(x, seed=1)
    cu = None if shape.lengths is None else torch.tensor(C.cu_seqlens_of(shape.lengths), dtype=torch.int64)
    xl = C.leaves(x)
    names = [n for n in C.INPUTS if xl.get(n) is not None]
    tracker = Tracker()
    pkg = package_at(package)
    t0 = time.perf_counter()
    with chunk_driver.forced(launch=launch, on_alloc=tracker, overlap=ORDERS[order]):
        o, ht = ops.chunk_rwkv7(xl["r"], xl["w"], xl["k"], xl["v"], xl["a"], xl["b"], initial_state=xl["h0"],
                                output_final_state=True, cu_seqlens=cu, package=pkg, lower_bound=bound)
        grads = torch.autograd.grad((o, ht), [xl[n] for n in names], (do, dht))
        variant = ops.variant_for(pkg, "chunk", xl["r"], xl["v"], xl["w"], cu, None, bound)
    del o, ht, grads
    x_bytes = shape.B * shape.T * shape.H * shape.D * x["r"].element_size()
    return {"variant": variant, "peak_bytes": tracker.peak, "peak_gb": round(tracker.peak / 1e9, 3),
            "peak_x": round(tracker.peak / x_bytes, 3), "x_bytes": x_bytes, "allocations": tracker.count,
            "at_peak": tracker.at_peak, "seconds": round(time.perf_counter() - t0, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", help="comma list of BxTxHxD or the bench's shape names (default: the bench's shapes, "
                                     "one per distinct size)")
    ap.add_argument("--package", default="generated/hopper")
    ap.add_argument("--bounds", default="-0.61,none",
                    help="comma list of lower_bound values; none: the call without it (any-gate variants)")
    ap.add_argument("--orders", default=",".join(ORDERS),
                    help="comma list of the backward's pass orders: one_stream (the reverse pass first) and/or "
                         "side_by_side (the states pass beside the reverse pass, as a GPU runs it where both "
                         "grids fit)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    args.order_list = [o.strip() for o in args.orders.split(",")]
    if not set(args.order_list) <= set(ORDERS):
        ap.error(f"--orders {args.orders!r}: valid are {', '.join(ORDERS)}")
    try:
        args.bound_values = [None if b.strip() == "none" else float(b) for b in args.bounds.split(",")]
    except ValueError:
        ap.error(f"--bounds {args.bounds!r}: give numbers or 'none', comma-separated")
    if args.dry_run:
        args.shape_list = BENCH.DRY_SHAPES
    elif args.shapes:
        try:
            args.shape_list = [C.parse_shape(s, BENCH.PRESETS) for s in args.shapes.split(",")]
        except ValueError as e:
            ap.error(str(e))
    else:
        # call forms that differ only in cu_seqlens' dtype or freshness allocate alike: one of each size
        seen: dict[tuple[Any, ...], C.Shape] = {}
        for s in BENCH.SHAPES.values():
            seen.setdefault((s.B, s.T, s.H, s.D, s.lengths), s)
        args.shape_list = list(seen.values())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # the CPU runs the op (its kernels' launches skipped)
    package = C.dry_run_package() if args.dry_run else args.package
    cases: dict[str, Any] = {}
    for shape in args.shape_list:
        for bound, order in ((b, o) for b in args.bound_values for o in args.order_list):
            key = f"{shape.label}, lower_bound={bound}, {order}"
            cases[key] = count(package, shape, bound, order)
            r = cases[key]
            print(f"{key}: peak {r['peak_gb']} GB = {r['peak_x']} X ({r['variant']}, {r['allocations']} buffers)")
            for b in r["at_peak"][:8]:
                print(f"    {b['bytes'] / r['x_bytes']:6.2f} X  {b['dtype']:9s} {str(b['shape']):24s} {b['allocated_by']}")
    import torch

    name = Path(package).name if not args.dry_run else "dry_run"
    out = C.out_dir() / f"memory_peak_{name}.json"
    C.write_json(out, {
        "what": "the driver's buffers alive at once over one forward+backward, launches skipped (CPU count)",
        "date": C.stamp(), "torch": torch.__version__, "dplr_gen_source_sha": C.source_digest(),
        "package": str(package), "cases": cases,
    })
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

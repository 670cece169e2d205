"""Cost of checking the lower_bound promise (dplr_gen.runtime.gate_check) at the benchmark shapes, on one GPU.

    python benchmarks/lower_bound_check.py OUT.json [--shapes 4x4096x32x64,...] [--rounds 5] [--dry-run]

Per shape (bf16 RWKV-7 inputs, lower_bound=-0.61, the dplr-fast system of benchmarks/bench.py): forward and
forward+backward, do_bench medians, with the check on and off (DPLR_GEN_CHECK_LOWER_BOUND), alternated over
``rounds`` rounds so that drift hits both; reported: the median of each, the overhead in percent, the check's
separate kernel alone (the async assert on the prep's "promise kept" flag) and, for comparison, the
reduction form that variants without the in-kernel check use (min over w, compare, async assert). Aim:
under 1 %. The bounded preps compare every gate whether the check is on or off (off, they clear a scratch
flag), so "unchecked" here still holds that compare: its cost is this fwd_checked_ms against fwd_unchecked_ms
of a commit before the in-kernel check (run with that commit's copy of this script). Needs the spec for this
GPU built. --dry-run: a tiny fp32 shape on CPU (TRITON_INTERPRET=1), to check that the script runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(shape: Any, device: str, dtype: Any, rounds: int, warmup: int, rep: int) -> dict[str, Any]:
    import torch

    from benchmarks import common as C
    from dplr_gen.runtime import dispatch, gate_check

    package = dispatch.default_package().package_for(torch.device(device)).dir
    op, info = C.load_op(C.SYSTEMS["dplr-fast"], package)
    x = C.leaves(C.rwkv7_case(shape.B, shape.T, shape.H, shape.D, dtype=dtype, device=device, seed=1,
                              n_states=shape.N))
    do, dht = C.grad_outputs(x, seed=1)
    cu, cu_cpu = C.cu_tensors(shape.lengths, "int32", device)
    fwd, fwd_bwd = C.step_closures(op, x, do, dht, cu, cu_cpu)
    times: dict[str, list[float]] = {f"{s}_{c}": [] for s in ("fwd", "fwd_bwd") for c in ("checked", "unchecked")}
    for _ in range(rounds):
        for check in ("checked", "unchecked"):
            os.environ[gate_check.CHECK_ENV] = "1" if check == "checked" else "0"
            times[f"fwd_{check}"].append(C.bench_ms(fwd, device, warmup, rep))
            times[f"fwd_bwd_{check}"].append(C.bench_ms(fwd_bwd, device, warmup, rep))
    os.environ[gate_check.CHECK_ENV] = "1"
    promise = gate_check.Promise(-0.61, torch.ones((1,), dtype=torch.int32, device=device))
    alone = C.bench_ms(lambda: gate_check.confirm(promise), device, warmup, rep)
    reduction = C.bench_ms(lambda: gate_check.check_lower_bound(x["w"], -0.61), device, warmup, rep)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "shape": shape.label, "package": str(package), "call": info, "rounds_ms": times,
        **{f"{k}_ms": v for k, v in med.items()},
        "fwd_overhead_pct": 100 * (med["fwd_checked"] / med["fwd_unchecked"] - 1),
        "fwd_bwd_overhead_pct": 100 * (med["fwd_bwd_checked"] / med["fwd_bwd_unchecked"] - 1),
        "check_alone_ms": alone, "reduction_check_ms": reduction,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="where the JSON result goes")
    ap.add_argument("--shapes", default="", help="comma-separated BxTxHxD or preset names (default: bench.py's)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of checked / unchecked per shape")
    ap.add_argument("--dry-run", action="store_true", help="tiny fp32 shape on CPU under the interpreter")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from benchmarks import bench
    from benchmarks import common as C

    if args.dry_run:
        device, dtype, warmup, rep = "cpu", torch.float32, 1, 1
        shapes = [bench.DRY_SHAPES[0]]
        args.rounds = min(args.rounds, 1)
    else:
        device, dtype, warmup, rep = "cuda", torch.bfloat16, 25, 100
        labels = [s for s in args.shapes.split(",") if s]
        shapes = [bench.parse_shape_any(s) for s in labels] or list(bench.SHAPES.values())
    report: dict[str, Any] = {"machine": C.machine_info(device), "aim_pct": 1.0, "shapes": []}
    for shape in shapes:
        try:
            row = measure(shape, device, dtype, args.rounds, warmup, rep)
        except Exception as e:  # one shape's failure (e.g. memory) does not lose the others
            row = {"shape": shape.label, "error": f"{type(e).__name__}: {e}"[:2000]}
        report["shapes"].append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
               if k in ("shape", "fwd_checked_ms", "fwd_unchecked_ms", "fwd_overhead_pct", "fwd_bwd_overhead_pct",
                        "check_alone_ms", "reduction_check_ms", "error")}, flush=True)
        C.write_json(args.out, report)
        C.free(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a dplr-gen forward+backward spends its time: GPU time per kernel (torch's profiler), host time per call.

    python scripts/kernel_profile.py [--cases varlen11,dense4x4096,...] [--package generated/hopper]

Per case (bf16 RWKV-7 inputs, random initial state, output_final_state=True, gradients of every input and h0 via
torch.autograd.grad), with each --bounds value (default: lower_bound=-0.61, the bounded variants, and the call
without it, any gate):
  enqueue_ms      host time per call: 20 calls back to back, timed before the device is waited for;
  wall_ms         the same 20 calls until the device is done, per call;
  kernels         GPU microseconds per call of each kernel (the mean of 5 profiled calls) and launches per call;
  kernel_us_total their sum;
  host_functions  with --host-functions N: the N Python functions (and C functions called from Python: launches,
                  allocations) with the most own host time per call, by cProfile over the 20 calls (its own
                  overhead inflates the many small calls; the ranking is what it is for);
  exact_chunks    dense cases whose variant flags chunks (any gate, the token pass or the preps split by chunk):
                  the (chunk, head) pairs the backward prep flags for the exact form, of how many, and how many
                  programs an SM holds of each persistent kernel (null: unknown, so one program a work item).
--gates: the gate data, rwkv7 (default; every chunk allows the factored form), mixed (benchmarks.common.mixed_gates:
one steep chunk in 16, resets and a steep run) or steep (every gate -5: every chunk takes the exact form); the
last two only without lower_bound (they break it). The varlen case passes cu_seqlens as int64 (fla's type hint),
as the bench's call forms do. Writes
$OUT/kernel_profile_<package folder name>.json (./out/ without $OUT) and prints the largest kernels of each case. --dry-run: CPU,
Triton's interpreter, tiny fp32 shapes, no profiler (the control flow only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common as C  # noqa: E402

# name -> (B, T, H, D, sequence lengths or None)
CASES: dict[str, tuple[int, int, int, int, tuple[int, ...] | None]] = {
    "varlen11": (1, sum(C.LENGTHS11), 32, 64, C.LENGTHS11),
    "dense8x4096": (8, 4096, 32, 64, None),
    "dense4x4096": (4, 4096, 32, 64, None),
    "dense8x4096x64": (8, 4096, 64, 64, None),
    "dense8x2048x16x128": (8, 2048, 16, 128, None),
    "dense1x32768": (1, 32768, 32, 64, None),
    "host1x4096x2x128": (1, 4096, 2, 128, None),
}
DRY_CASES = {"varlen11": (1, 63, 1, 64, (1, 15, 17, 30)), "dense4x4096": (2, 40, 1, 64, None)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help=f"comma list of {', '.join(CASES)} (default: all)")
    ap.add_argument("--package", default="generated/hopper")
    ap.add_argument("--bounds", default="-0.61,none",
                    help="comma list of the lower_bound values to profile; none: the call without it")
    ap.add_argument("--gates", default="rwkv7", choices=["rwkv7", "mixed", "steep"])
    ap.add_argument("--host-functions", type=int, default=0, metavar="N",
                    help="also record the N functions with the most own host time per call (cProfile)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    table = DRY_CASES if args.dry_run else CASES
    args.case_names = args.cases.split(",") if args.cases else list(table)
    try:
        args.bound_values = [None if b.strip().lower() == "none" else float(b) for b in args.bounds.split(",")]
    except ValueError:
        ap.error(f"--bounds: {args.bounds!r}: a comma list of numbers and 'none'")
    if args.gates != "rwkv7" and any(b is not None for b in args.bound_values):
        ap.error(f"--gates {args.gates}: gates that break any lower_bound; profile them with --bounds none")
    unknown = [c for c in args.case_names if c not in table]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; valid: {sorted(table)}")
    return args


def case_inputs(shape: tuple[int, int, int, int, tuple[int, ...] | None], device: str, dry: bool,
                gates: str = "rwkv7") -> dict[str, Any]:
    """A case's RWKV-7 inputs (bf16, fp32 when ``dry``) with the ``gates`` asked for."""
    import torch

    B, T, H, D, lens = shape
    dtype = torch.float32 if dry else torch.bfloat16
    x = C.rwkv7_case(B, T, H, D, dtype=dtype, device=device, seed=0, n_states=len(lens) if lens else None)
    if gates == "mixed":
        C.mixed_gates(x["w"])
    elif gates == "steep":
        x["w"].fill_(-5.0)
    return x


def exact_chunks(ks: Any, v: Any, x: dict[str, Any]) -> dict[str, Any] | None:
    """For dense inputs ``x`` of variant ``v`` (kernel set ``ks``): how many (chunk, head) pairs its backward prep
    flags for the exact form, of how many, and the programs an SM holds of each persistent kernel; None where the
    variant flags no chunks (bounded, or nothing split by chunk)."""
    from dplr_gen.runtime import chunk_driver as D
    from dplr_gen.runtime.ops import TORCH_DTYPES

    gk = x["w"].to(TORCH_DTYPES[v.gate_dtype])
    n_slots = D._layout(v.chunk_size, x["r"], None)[1]
    pr = D.chunk_prep(ks, v, x["r"], x["k"], x["a"], x["b"], gk, None, n_slots, for_bwd=True)
    if pr.fac is None:
        return None
    dev = x["r"].device
    return {"flagged": int((pr.fac == 0).sum()), "of": pr.fac.numel(), "sms": D._device_sms(dev),
            "resident_per_sm": {n: ks.resident_per_sm(n, dev) for n in ks.option("persistent", ())}}


def case_call(op: Any, shape: tuple[int, int, int, int, tuple[int, ...] | None], lower_bound: float | None,
              device: str, dry: bool, gates: str = "rwkv7", x: dict[str, Any] | None = None) -> Any:
    """One forward+backward of ``op`` (chunk_rwkv7's signature) on a case's inputs, made once: bf16 (fp32 when
    ``dry``) RWKV-7 inputs with the ``gates`` asked for (``x``: those of ``case_inputs``, made by the caller),
    cu_seqlens in int64 for varlen cases, gradients of every input and h0 through torch.autograd.grad.
    (scripts/hardware_profile.py profiles the same call.)"""
    import torch

    lens = shape[4]
    x = case_inputs(shape, device, dry, gates) if x is None else x
    cu = None if lens is None else torch.tensor(C.cu_seqlens_of(lens), dtype=torch.int64, device=device)
    xl = C.leaves(x)
    do, dht = C.grad_outputs(x, 1)
    names = [n for n in ("r", "w", "k", "v", "a", "b", "h0") if xl.get(n) is not None]

    def call() -> Any:
        o, ht = op(xl["r"], xl["w"], xl["k"], xl["v"], xl["a"], xl["b"], scale=1.0, initial_state=xl["h0"],
                   output_final_state=True, cu_seqlens=cu, lower_bound=lower_bound)
        return torch.autograd.grad((o, ht), [xl[n] for n in names], (do, dht))

    return call


def host_functions(call: Any, n_calls: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by own host time over ``n_calls`` calls of ``call`` (cProfile), per call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n_calls):
        call()
    prof.disable()
    rows = [{"function": f"{Path(file).name}:{line}({fn})", "calls": round(nc / n_calls, 2),
             "own_us": round(tt / n_calls * 1e6, 2), "total_us": round(ct / n_calls * 1e6, 2)}
            for (file, line, fn), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]  # type: ignore[attr-defined]
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def profile_case(op: Any, shape: tuple[int, int, int, int, tuple[int, ...] | None], lower_bound: float | None,
                 device: str, dry: bool, gates: str = "rwkv7", x: dict[str, Any] | None = None,
                 n_host_functions: int = 0) -> dict[str, Any]:
    import torch

    call = case_call(op, shape, lower_bound, device, dry, gates, x)
    for _ in range(1 if dry else 3):
        call()
    C.sync(device)
    n = 2 if dry else 20
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    enqueue = (time.perf_counter() - t0) / n
    C.sync(device)
    wall = (time.perf_counter() - t0) / n
    rec: dict[str, Any] = {"enqueue_ms": enqueue * 1e3, "wall_ms": wall * 1e3}
    if n_host_functions:
        rec["host_functions"] = host_functions(call, n, n_host_functions)
        C.sync(device)
    if dry:
        return rec
    from torch.profiler import ProfilerActivity, profile

    calls = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total / calls
            per[e.name][1] += 1 / calls
    rec["kernels"] = {k: {"us": round(v[0], 1), "count": round(v[1], 2)}
                      for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])}
    rec["kernel_us_total"] = sum(v[0] for v in per.values())
    return rec


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from dplr_gen.runtime import ops
    from dplr_gen.runtime.loader import package_at

    device = "cpu" if args.dry_run else "cuda"
    table = DRY_CASES if args.dry_run else CASES
    pkg = package_at(args.package)

    def op(*a: Any, **k: Any) -> Any:
        return ops.chunk_rwkv7(*a, package=pkg, **k)

    out_dir = Path(os.environ.get("OUT") or "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    gates = "" if args.gates == "rwkv7" else f"_{args.gates}_gates"
    out_file = out_dir / f"kernel_profile_{Path(args.package).name}{gates}.json"
    result: dict[str, Any] = {"script": "scripts/kernel_profile.py", "machine": C.machine_info(device),
                              "package": args.package, "gates": args.gates, "cases": {}}
    for name in args.case_names:
        x = case_inputs(table[name], device, args.dry_run, args.gates)  # every bound's call reads the same inputs
        for lb in args.bound_values:
            key = f"{name}, lower_bound={lb}"
            rec = profile_case(op, table[name], lb, device, args.dry_run, args.gates, x, args.host_functions)
            if table[name][4] is None:
                vname = ops.variant_for(pkg, "chunk", x["r"], x["v"], x["w"], None, None, lb)
                ks = pkg.kernel_set(vname, pkg.target_for(torch.device(device)))
                rec["exact_chunks"] = exact_chunks(ks, pkg.variants[vname], x)
            result["cases"][key] = {"shape": list(table[name][:4]), "lengths": table[name][4], **rec}
            line = f"{key}: enqueue {rec['enqueue_ms']:.3f} ms, wall {rec['wall_ms']:.3f} ms"
            if "kernel_us_total" in rec:
                line += f", kernels {rec['kernel_us_total'] / 1e3:.3f} ms"
            print(line, flush=True)
            if rec.get("exact_chunks"):
                print(f"    exact form: {rec['exact_chunks']}", flush=True)
            for k, v in list(rec.get("kernels", {}).items())[:10]:
                print(f"    {v['us']:9.1f} us x{v['count']:g}  {k[:90]}", flush=True)
            for f in rec.get("host_functions", [])[:15]:
                print(f"    host {f['own_us']:8.1f} us own, {f['total_us']:8.1f} total, x{f['calls']:g}  "
                      f"{f['function'][:80]}", flush=True)
            out_file.write_text(json.dumps(C.jsonable(result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Context parallelism on GPUs (dplr_gen/cp.py): bf16 accuracy against the one-GPU op, weak scaling of forward+backward.

One process per GPU: the script spawns itself over every visible GPU (or runs under torchrun). For each group size
w in --worlds (default 2, 4 where that many GPUs are visible; the group is ranks 0..w-1):
  * accuracy: RWKV-7 inputs (bf16, w in bf16, lower_bound=-0.61), T_global = w x --acc-tokens, H = 4, a dense
    batch (one sequence) and a varlen one (sequences inside ranks, crossings, a 1-token sequence at the end), random
    initial states, gradients of every input through o and the final states. Errors are relative norms against the
    one-GPU fp32 op on the same values; PASS where every CP error <= 1.1 x the one-GPU bf16 op's error + 1e-4;
  * speed: one sequence of w x --tokens tokens (H = --heads, K = V = --dim, no initial state), forward+backward of
    every input, --iters timed iterations (each after a barrier), the slowest rank's median; against one GPU (rank 0
    alone) running --tokens tokens; efficiency = one-GPU time / CP time (weak scaling). Also: every rank of the
    group running the one-GPU op at once (contention without communication), and the bytes each rank sends and
    receives per call (counted at the exchange), whether a call synchronises with the device (CUDA's sync
    debug mode), and the forward alone (no grad) for both;
  * fla-core's CP on the same speed inputs where ``fla.ops.cp`` imports (its errors recorded otherwise).
JSON to the path given.

    python benchmarks/cp_bench.py results.json                    # all visible GPUs
    torchrun --nproc-per-node 4 benchmarks/cp_bench.py results.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NAMES = ("r", "w", "k", "v", "a", "b")
QUANTITIES = ("o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0")
LOWER_BOUND = -0.61


def _inputs(T: int, H: int, K: int, N: int, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Any]:
    """The same global inputs on every rank (generated on the host from one seed)."""
    from dplr_gen.testing import rwkv7_inputs

    x = rwkv7_inputs(1, T, H, K, dtype=torch.float32, seed=seed, initial_state=False)
    gen = torch.Generator().manual_seed(seed + 1)
    out = {"r": x["q"], "w": x["gk"], "k": x["k"], "v": x["v"], "a": x["a"], "b": x["b"]}
    out = {n: t.to(device=device, dtype=dtype) for n, t in out.items()}
    out["h0"] = (torch.randn(N, H, K, K, generator=gen) * 0.5).to(device)
    out["do"] = torch.randn(1, T, H, K, generator=gen).to(device=device, dtype=dtype)
    out["dht"] = torch.randn(N, H, K, K, generator=gen).to(device)
    return out


def _run(op: Callable, x: dict[str, Any], rows: slice, dtype: torch.dtype, **kw: Any) -> dict[str, torch.Tensor]:
    """op forward and backward on rows of x (in dtype): o, the final states and every gradient."""
    xs = {n: x[n][:, rows].to(dtype).detach().clone().requires_grad_(True) for n in NAMES}
    h0 = x["h0"].clone().requires_grad_(True)
    o, ht = op(*(xs[n] for n in NAMES), scale=1.0, initial_state=h0, output_final_state=True,
               lower_bound=LOWER_BOUND, **kw)
    torch.autograd.backward((o, ht), (x["do"][:, rows].to(dtype), x["dht"]))
    return {"o": o, "ht": ht, "dh0": h0.grad, **{f"d{n}": xs[n].grad for n in NAMES}}


def _errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rows: slice, group: Any, sliced: bool
            ) -> dict[str, float]:
    """Relative norm errors over the whole batch: each rank's rows (``sliced``), summed final states and
    initial-state gradients (cp.py's convention)."""
    out = {}
    for n in QUANTITIES:
        g = got[n].double()
        r = ref[n].double()
        if n in ("ht", "dh0"):
            if sliced:
                dist.all_reduce(g, group=group)
            num, den = (g - r).pow(2).sum(), r.pow(2).sum()
        else:
            r = r[:, rows] if sliced else r
            num, den = (g - r).pow(2).sum(), r.pow(2).sum()
            if sliced:
                nd = torch.stack([num, den])
                dist.all_reduce(nd, group=group)
                num, den = nd[0], nd[1]
        out[n] = float((num / den.clamp_min(1e-300)).sqrt())
    return out


def accuracy(op: Callable, build: Callable, w: int, group: Any, rank: int, T_local: int, dev: torch.device,
             dtype: torch.dtype) -> dict[str, Any]:
    T = w * T_local
    layouts = {"dense": [0, T], "varlen": sorted({0, 1000, T // 2 + 7, T - T_local // 3, T - 1, T})}
    out = {}
    for name, offsets in layouts.items():
        cu = torch.tensor(offsets, dtype=torch.int64, device=dev)
        x = _inputs(T, 4, 64, len(offsets) - 1, dtype, dev, seed=w * 10 + len(offsets))
        kw = {} if len(offsets) == 2 else {"cu_seqlens": cu}
        ref = _run(op, x, slice(None), torch.float32, **kw)
        one = _run(op, x, slice(None), dtype, **kw)
        rows = slice(rank * T_local, (rank + 1) * T_local)
        cp = _run(op, x, rows, dtype, cp_context=build(cu, group=group))
        e_cp = _errors(cp, ref, rows, group, True)
        e_one = _errors(one, ref, rows, group, False)
        ok = all(e_cp[n] <= 1.1 * e_one[n] + 1e-4 for n in QUANTITIES)
        out[name] = {"offsets": offsets, "cp": e_cp, "one_gpu": e_one, "pass": ok}
    return out


def _time(fn: Callable[[], None], iters: int, group: Any, warmup: int = 3) -> float:
    """Median ms of fn over iters, each started after a barrier of the group; the slowest rank's median."""
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cuda")
    if group is not None:
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return float(med)


def _step(op: Callable, x: dict[str, Any], do: torch.Tensor, **kw: Any) -> Callable[[], None]:
    def fn() -> None:
        for t in x.values():
            t.grad = None
        o, _ = op(*(x[n] for n in NAMES), scale=1.0, lower_bound=LOWER_BOUND, **kw)
        o.backward(do)
    return fn


def _forward(op: Callable, x: dict[str, Any], **kw: Any) -> Callable[[], None]:
    def fn() -> None:
        with torch.no_grad():
            op(*(x[n] for n in NAMES), scale=1.0, lower_bound=LOWER_BOUND, **kw)
    return fn


def speed(op: Callable, build: Callable, w: int, group: Any, rank: int, args: argparse.Namespace,
          dev: torch.device) -> dict[str, Any]:
    from dplr_gen import cp

    T, H, K = args.tokens, args.heads, args.dim
    gen_x = _inputs(T, H, K, 1, torch.bfloat16, dev, seed=100 + rank)
    x = {n: gen_x[n].requires_grad_(True) for n in NAMES}
    res: dict[str, Any] = {"T_local": T, "H": H, "K": K, "V": K, "world": w}
    single = None
    if rank == 0:
        single = _time(_step(op, x, gen_x["do"]), args.iters, None)
    dist.barrier(group=group)
    res["one_gpu_ms"] = single
    res["one_gpu_concurrent_ms"] = _time(_step(op, x, gen_x["do"]), args.iters, group)
    cu = torch.tensor([0, w * T], dtype=torch.int64, device=dev)
    ctx = build(cu, group=group)
    sent: list[int] = []
    real = cp._all_gather

    def counting(t: torch.Tensor, c: Any, *rest: Any) -> Any:
        sent.append(t.numel() * t.element_size())
        return real(t, c, *rest)

    cp._all_gather = counting
    try:
        # a call that reads anything back from the device (a synchronising CUDA call) raises here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(op, x, gen_x["do"], cp_context=ctx)()
            res["device_syncs"] = "none"
        except RuntimeError as e:
            res["device_syncs"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        res["bytes_sent_per_call"] = sum(sent)
        res["bytes_received_per_call"] = sum(sent) * (w - 1)
        res["collectives_per_call"] = len(sent)
    finally:
        cp._all_gather = real
    res["cp_ms"] = _time(_step(op, x, gen_x["do"], cp_context=ctx), args.iters, group)
    # the forward alone, to tell where the time beyond the one-GPU op goes
    single_fwd = _time(_forward(op, x), args.iters, None) if rank == 0 else None
    dist.barrier(group=group)
    res["one_gpu_forward_ms"] = single_fwd
    res["cp_forward_ms"] = _time(_forward(op, x, cp_context=ctx), args.iters, group)
    if rank == 0:
        res["efficiency"] = single / res["cp_ms"]
    return res


def fla_speed(w: int, group: Any, rank: int, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """fla-core's CP on the inputs ``speed`` times (the same seeds)."""
    gen_x = _inputs(args.tokens, args.heads, args.dim, 1, torch.bfloat16, dev, seed=100 + rank)
    x = {n: gen_x[n].requires_grad_(True) for n in NAMES}
    do = gen_x["do"]
    out: dict[str, Any] = {}
    err = None
    try:
        from fla.ops.cp import build_cp_context as fla_build
        from fla.ops.rwkv7 import chunk_rwkv7 as fla_op
    except Exception as e:  # noqa: BLE001 - recorded
        err = f"import: {type(e).__name__}: {e}"
    # every rank must take the same branches (collectives follow): agree on whether fla imports everywhere
    ok = torch.tensor([0 if err else 1], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not int(ok):
        return {"error": err or "fla did not import on another rank"}
    try:
        if rank == 0:
            out["one_gpu_ms"] = _time(_step(fla_op, x, do), args.iters, None)
        dist.barrier(group=group)
        ctx = fla_build(torch.tensor([0, w * args.tokens], dtype=torch.int64, device=dev), group=group)
        out["cp_ms"] = _time(_step(fla_op, x, do, cp_context=ctx), args.iters, group)
        if rank == 0:
            out["efficiency"] = out["one_gpu_ms"] / out["cp_ms"]
    except Exception as e:  # noqa: BLE001 - recorded (a failure on one rank may leave the others waiting)
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def main_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    import dplr_gen
    from dplr_gen.cp import build_cp_context

    op = dplr_gen.chunk_rwkv7
    worlds = [w for w in (int(s) for s in args.worlds.split(",")) if 2 <= w <= world]
    report: dict[str, Any] = {"gpus": world, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                              "args": vars(args), "runs": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    for w in worlds:
        group = dist.new_group(list(range(w)))  # every rank takes part in creating it
        entry: dict[str, Any] = {}
        if rank < w:
            try:
                entry["accuracy"] = accuracy(op, build_cp_context, w, group, rank, args.acc_tokens, dev,
                                             torch.bfloat16)
                entry["speed"] = speed(op, build_cp_context, w, group, rank, args, dev)
            except Exception:  # noqa: BLE001 - recorded; the other ranks may then fail or wait
                entry["error"] = traceback.format_exc()
        report["runs"][str(w)] = entry
        if rank == 0:  # written before fla runs: its autotuning may outlast the time left
            Path(args.out).write_text(json.dumps(report, indent=1))
        if args.fla and rank < w and "error" not in entry:
            entry["speed"]["fla"] = fla_speed(w, group, rank, args, dev)
        dist.barrier()
        torch.cuda.empty_cache()
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(json.dumps({w: {"accuracy_pass": {k: v["pass"] for k, v in r.get("accuracy", {}).items()},
                              "efficiency": r.get("speed", {}).get("efficiency"),
                              "cp_ms": r.get("speed", {}).get("cp_ms"), "one_gpu_ms": r.get("speed", {}).get("one_gpu_ms"),
                              "error": r.get("error", "")[-300:]} for w, r in report["runs"].items()}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    main_rank(rank, world, args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per GPU for the speed runs")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64, help="K = V")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--acc-tokens", type=int, default=4096, help="tokens per GPU for the accuracy checks")
    ap.add_argument("--worlds", default="2,4", help="group sizes to run (those up to the GPUs present)")
    ap.add_argument("--fla", action=argparse.BooleanOptionalAction, default=True, help="fla-core's CP too")
    args = ap.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        main_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    n = torch.cuda.device_count()
    if n < 2:
        print("cp_bench: needs at least 2 GPUs", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(n, port, args), nprocs=n, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

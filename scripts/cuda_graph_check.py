"""Every op form captured in a CUDA graph replays correctly: forward, forward+backward and decode steps.

    python scripts/cuda_graph_check.py [--package generated/hopper]      # on a GPU; writes $OUT/cuda_graph_check_<date>.json

Per case: the call is warmed up on a side stream and captured with static inputs; new random values (and, for
varlen, new sequence lengths of the same count) are copied into those inputs, the graph is replayed, and its
outputs and gradients are compared with an eager call on the new values (relative norm error; the same kernels
run, so the bound is tight). Cases: chunk_rwkv7 dense with and without lower_bound, varlen with int64 and int32
cu_seqlens (its values changed between capture and replay), the forward alone, forward+backward through
torch.cuda.make_graphed_callables (graphed once, called on new leaves, against eager); fused_recurrent_rwkv7,
fused_mul_recurrent_rwkv7 and the state-pool form (ssm_state_indices) as decode steps. Without lower_bound, mixed gates
(K = 64 and 128) put some chunks on the any-gate variants' exact form, other chunks at replay than at capture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common as C  # noqa: E402

BOUND = 1e-5  # same kernels, same inputs: only the order of float atomics (none here) could differ


def _flat(out: Any) -> list[Any]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]


def _compare(replayed: Any, eager: Any) -> float:
    return max(C.rel_err(a, b) for a, b in zip(_flat(replayed), _flat(eager)))


def chunk_case(pkg: Any, lengths: list[int] | None, cu_dtype: str, lower_bound: float | None,
               backward: bool, seed: int, D: int = 64, gates: str = "rwkv7") -> dict[str, Any]:
    """``gates`` "mixed" (benchmarks.common.mixed_gates): some chunks take the any-gate variants' exact form; the
    replay's gates are shifted by 48 tokens, so that other chunks do (the flags are found on the device)."""
    import torch

    from dplr_gen.runtime import ops

    T = 512 if lengths is None else sum(lengths)
    B = 2 if lengths is None else 1
    x = C.rwkv7_case(B, T, 4, D, dtype=torch.bfloat16, device="cuda", seed=seed,
                     n_states=None if lengths is None else len(lengths))
    if gates == "mixed":
        C.mixed_gates(x["w"])
    do, dht = C.grad_outputs(x, seed)
    cu = None if lengths is None else torch.tensor(C.cu_seqlens_of(lengths), dtype=getattr(torch, cu_dtype),
                                                   device="cuda")
    leaves = {n: t.detach().clone().requires_grad_(backward) for n, t in x.items()}

    def call() -> Any:
        o, ht = ops.chunk_rwkv7(leaves["r"], leaves["w"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                                initial_state=leaves["h0"], output_final_state=True, cu_seqlens=cu,
                                lower_bound=lower_bound, package=pkg)
        if not backward:
            return o, ht
        return (o, ht, *torch.autograd.grad((o, ht), [leaves[n] for n in C.INPUTS], (do, dht)))

    g, static = C.capture(call, warm=2)
    # new values in the same tensors (and, varlen, other lengths: the same count, the same total)
    y = C.rwkv7_case(B, T, 4, D, dtype=torch.bfloat16, device="cuda", seed=seed + 1,
                     n_states=None if lengths is None else len(lengths))
    if gates == "mixed":
        C.mixed_gates(y["w"])
        y["w"] = torch.roll(y["w"], 48, dims=1)
    with torch.no_grad():
        for n in C.INPUTS:
            leaves[n].copy_(y[n])
        if cu is not None:
            other = lengths[::-1]
            cu.copy_(torch.tensor(C.cu_seqlens_of(other), dtype=cu.dtype))
    g.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in _flat(static)]
    eager = call()
    return {"max_rel_err": _compare(replayed, eager), "outputs": len(replayed)}


def graphed_case(pkg: Any, lower_bound: float | None, seed: int) -> dict[str, Any]:
    """The op through torch.cuda.make_graphed_callables (a host-bound training step's form): forward and
    backward captured once on sample inputs, then called on new leaves, against an eager call on those."""
    import torch

    from dplr_gen.runtime import ops

    def op(xl: dict[str, Any], cu: Any = None) -> Any:
        return ops.chunk_rwkv7(xl["r"], xl["w"], xl["k"], xl["v"], xl["a"], xl["b"], initial_state=xl["h0"],
                               output_final_state=True, lower_bound=lower_bound, package=pkg)

    x = C.rwkv7_case(1, 1024, 2, 128, dtype=torch.bfloat16, device="cuda", seed=seed)
    do, dht = C.grad_outputs(x, seed)
    leaves = C.leaves(x)
    graphed = C.graphed_fwd_bwd(op, leaves, do, dht)
    y = C.rwkv7_case(1, 1024, 2, 128, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    with torch.no_grad():
        for n in C.INPUTS:
            leaves[n].copy_(y[n])
    got = [t.clone() for t in graphed()]
    eager = torch.autograd.grad(op(leaves), [leaves[n] for n in C.INPUTS], (do, dht))
    return {"max_rel_err": _compare(got, eager), "outputs": len(got)}


def decode_case(pkg: Any, form: str, seed: int) -> dict[str, Any]:
    import torch

    from dplr_gen.runtime import ops

    B, H, D = 4, 4, 64
    x = C.rwkv7_case(B, 1, H, D, dtype=torch.bfloat16, device="cuda", seed=seed)
    kk, rate = (-x["a"]).contiguous(), torch.rand_like(x["a"])
    kw: dict[str, Any] = {"package": pkg}
    state = x["h0"]
    if form == "pool":
        state = torch.randn(2 * B, H, D, D, device="cuda")
        kw["ssm_state_indices"] = torch.tensor([5, 0, -1, 2], dtype=torch.int32, device="cuda")

    def call() -> Any:
        with torch.inference_mode():
            if form == "fused":
                return ops.fused_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], initial_state=state,
                                                 output_final_state=True, **kw)
            return ops.fused_mul_recurrent_rwkv7(x["r"], x["w"], x["k"], x["v"], kk, rate, initial_state=state,
                                                 output_final_state=True, **kw)

    before = state.clone()
    g, static = C.capture(call, warm=2)
    y = C.rwkv7_case(B, 1, H, D, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    for n in ("r", "w", "k", "v", "a", "b"):
        x[n].copy_(y[n])
    kk.copy_(-y["a"])
    state.copy_(before)
    g.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in _flat(static)]
    state.copy_(before)
    eager = [t.clone() for t in _flat(call())]
    return {"max_rel_err": _compare(replayed, eager), "outputs": len(replayed)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", default=str(C.REPO / "generated" / "hopper"))
    args = ap.parse_args(argv)
    from dplr_gen.runtime.loader import package_at

    pkg = package_at(args.package)
    lens = [100, 300, 112]
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "chunk dense, lower_bound, fwd+bwd": lambda: chunk_case(pkg, None, "int64", C.GATE_BOUND, True, 1),
        "chunk dense, no lower_bound, fwd+bwd": lambda: chunk_case(pkg, None, "int64", None, True, 2),
        "chunk dense, no lower_bound, mixed gates, fwd+bwd": lambda: chunk_case(pkg, None, "int64", None, True, 12,
                                                                               gates="mixed"),
        "chunk dense D=128, no lower_bound, mixed gates, fwd+bwd": lambda: chunk_case(pkg, None, "int64", None, True,
                                                                                     13, D=128, gates="mixed"),
        "chunk dense D=128, lower_bound, fwd+bwd": lambda: chunk_case(pkg, None, "int64", C.GATE_BOUND, True, 14,
                                                                     D=128),
        "chunk dense, lower_bound, fwd": lambda: chunk_case(pkg, None, "int64", C.GATE_BOUND, False, 3),
        "chunk varlen int64, lower_bound, fwd+bwd": lambda: chunk_case(pkg, lens, "int64", C.GATE_BOUND, True, 4),
        "chunk varlen int32, no lower_bound, fwd+bwd": lambda: chunk_case(pkg, lens, "int32", None, True, 5),
        "chunk varlen int64, fwd": lambda: chunk_case(pkg, lens, "int64", None, False, 6),
        "chunk through make_graphed_callables, lower_bound, fwd+bwd": lambda: graphed_case(pkg, C.GATE_BOUND, 10),
        "chunk through make_graphed_callables, no lower_bound, fwd+bwd": lambda: graphed_case(pkg, None, 11),
        "decode fused_recurrent_rwkv7": lambda: decode_case(pkg, "fused", 7),
        "decode fused_mul_recurrent_rwkv7": lambda: decode_case(pkg, "mul", 8),
        "decode state pool": lambda: decode_case(pkg, "pool", 9),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, run in cases.items():
        try:
            r = run()
            r["ok"] = r["max_rel_err"] <= BOUND
        except Exception as e:  # noqa: BLE001 - recorded per case
            r = {"ok": False, **C.error_record(e)}
        results[name] = r
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {name}: {r.get('max_rel_err', r.get('error'))}", flush=True)
    report = C.Report(C.out_dir() / f"cuda_graph_check_{C.stamp()}.json")
    report.data = {"machine": C.machine_info("cuda"), "bound": BOUND, "definition": __doc__, "cases": results}
    report.save()
    print(f"{sum(r['ok'] for r in results.values())}/{len(results)} cases replay correctly; wrote {report.path}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

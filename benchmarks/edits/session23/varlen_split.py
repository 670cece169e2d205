"""The varlen token pass as it ships (one persistent launch of the varlen kernel, which locates each work item
through the slot map) against one launch of the dense variant's kernel per sequence, on views of the tensors
(each sequence's rows, states and outputs; its location then comes from the arguments). Same inputs: those the
bench's varlen case hands its token pass. Outputs compared, NaN-poisoned first. (GPU machine)

    python benchmarks/edits/session23/varlen_split.py [--rounds 3]
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

    from dplr_gen import chunk_driver, ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", default="chunk_bf16_k64_v64_c16_varlen_gbm0p61_gbf16_sfp32")
    args = ap.parse_args()
    dev = torch.device("cuda")
    op, _ = C.load_op(C.SYSTEMS["dplr-fast"], args.package)
    pkg = str(Path(args.package).resolve())
    ks_v, var_v = ops._kernels(pkg, args.variant, dev)
    ks_d, var_d = ops._kernels(pkg, args.variant.replace("_varlen_", "_dense_"), dev)
    s = bench.VARLEN
    x = C.rwkv7_case(s.B, s.T, s.H, s.D, dtype=torch.bfloat16, device="cuda", seed=3, n_states=s.N)
    do, dht = C.grad_outputs(x, 3)
    cu, cu_cpu = C.cu_tensors(s.lengths, "int32", "cuda")
    offs = cu_cpu.tolist()
    seen = {}
    real = chunk_driver.chunk_dplr_bwd_tokens

    def capture(ks, v, saved, h, u, do_, dh, dr, dk_over_dr=False, dq_over_u=False, steps=()):
        if not seen:  # inputs kept (cloned: the real pass may write over U and dR)
            seen.update(ks=ks, v=v, saved=saved, h=h.clone(), u=u.clone(), do=do_.clone(), dh=dh.clone(),
                        dr=dr.clone())
        return real(ks, v, saved, h, u, do_, dh, dr, dk_over_dr, dq_over_u, steps)

    chunk_driver.chunk_dplr_bwd_tokens = capture
    try:
        _, step = C.step_closures(op, C.leaves(x), do, dht, cu, cu_cpu)
        step()
        torch.cuda.synchronize()
    finally:
        chunk_driver.chunk_dplr_bwd_tokens = real
    assert seen["ks"] is ks_v, "the varlen case did not run the expected variant"
    saved, h, u, dO, dh, dr = (seen[n] for n in ("saved", "h", "u", "do", "dh", "dr"))
    q, k, v_, a, b, gk = (saved[n] for n in ("q", "k", "v", "a", "b", "gk"))
    H, K, V = q.shape[2], q.shape[3], v_.shape[3]
    TC = saved["TC"]
    assert TC == chunk_driver.token_chunk(ks_d) and not chunk_driver.derives_states(ks_v)

    def shipped():
        return real(ks_v, var_v, saved, h, u, dO, dh, dr)

    outs = [torch.full_like(t, float("nan")) for t in (q, k, a, b, gk)]
    launches = []
    for n in range(len(offs) - 1):
        bos, eos = offs[n], offs[n + 1]
        first = bos // TC + n  # the sequence's first slot (chunk_driver's varlen slot numbering)
        nch = -(-(eos - bos) // TC)
        sl = (slice(None), slice(bos, eos))
        n_items = nch * H
        grid, extra = chunk_driver.persistent_launch(ks_d, chunk_driver.BWD, n_items, dev)
        launches.append(((grid,), (q[sl], k[sl], v_[sl], a[sl], b[sl], gk[sl], h[first:first + nch],
                                   dh[first:first + nch], u[sl], dr[sl], dO[sl], *(o[sl] for o in outs),
                                   saved["scale"], eos - bos, H, *extra)))
    kern = getattr(ks_d, chunk_driver.BWD)

    def split():
        for grid, a_ in launches:
            kern[grid](*a_)
        return outs

    side = torch.cuda.Stream()

    def split2():
        # consecutive sequences alternate between the current stream and a side one, so that one launch's
        # programs start while the last ones of the launch before finish
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        for i, (grid, a_) in enumerate(launches):
            if i % 2:
                with torch.cuda.stream(side):
                    kern[grid](*a_)
            else:
                kern[grid](*a_)
        cur.wait_stream(side)
        return outs

    ref = [t.clone() for t in shipped()]
    for o in outs:
        o.fill_(float("nan"))
    got = split()
    torch.cuda.synchronize()
    diffs = {nm: (r.float() - g.float()).abs().max().item() for nm, r, g in zip(("dq", "dk", "da", "db", "dg"), ref, got)}
    nan = {nm: int(g.isnan().sum().item()) for nm, g in zip(("dq", "dk", "da", "db", "dg"), got)}
    print("max abs diff", diffs, "nan", nan, flush=True)
    for o in outs:
        o.fill_(float("nan"))
    got = split2()
    torch.cuda.synchronize()
    diffs2 = {nm: (r.float() - g.float()).abs().max().item() for nm, r, g in zip(("dq", "dk", "da", "db", "dg"), ref, got)}
    print("split2 max abs diff", diffs2, flush=True)
    res: dict = {"diff": diffs, "diff_split2": diffs2, "nan": nan, "launches": len(launches),
                 "grids": [g[0] for g, _ in launches]}
    for rnd in range(args.rounds):
        for name, fn in (("shipped", shipped), ("split", split), ("split2", split2)):
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            res.setdefault(name, []).append(round(ms, 4))
            print(rnd, name, f"{ms:.4f} ms", flush=True)
    # host time of the split form's launches alone
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        split()
    res["split_host_ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 4)
    torch.cuda.synchronize()
    out = {"what": __doc__.splitlines()[0], "machine": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "variant": args.variant,
           "lengths": list(s.lengths), "rows": res}
    print(json.dumps(res))
    (Path(os.environ.get("OUT", ".")) / "varlen_split.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

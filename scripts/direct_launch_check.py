"""Direct launches against Triton's launch path, on a GPU: the same results bit for bit, Triton not imported,
and the host time of the small calls (dplr_gen/toolchain/launch_direct.py).

    python scripts/direct_launch_check.py [--package generated/hopper]

Fresh processes run the same calls with fixed inputs (bf16 RWKV-7 inputs; chunk forward+backward with and
without ``lower_bound`` at (2,1024,8,64) and (2,512,4,128), varlen with int64 ``cu_seqlens``, decode steps of
the fused recurrent op and its mul form, a pooled step): ``triton`` with DPLR_GEN_KEEP_STUBS=0 (every launch
through Triton's runner), ``direct`` as a user's process runs (the records the first process on the machine
kept). Each child says which launch path its kernels took and whether Triton was imported, and times, wall
per call of calls back to back: a decode step at B = 1 (both forms) and forward+backward at the host-bound
(1,4096,2,128). Writes $OUT/direct_launch_check.json; exit status 1 where results differ or the direct child
imported Triton.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import torch
from dplr_gen.runtime import ops
from dplr_gen.runtime.loader import package_at
from dplr_gen.testing import rwkv7_inputs
pkg = package_at(sys.argv[1])
dev = torch.device("cuda")
out = {}

def x_of(B, T, H, D, seed, grad=True, h0=True):
    x = rwkv7_inputs(B, T, H, D, dtype=torch.bfloat16, device=dev, seed=seed, initial_state=h0)
    return {n: v.requires_grad_(grad) for n, v in x.items() if v is not None}

def ms_per_call(fn, warmup, n):  # wall ms per call of n calls back to back, the best of 5 rounds
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3 / n

def fwd_bwd(tag, x, **kw):
    o, ht = ops.chunk_dplr_delta_rule(**x, output_final_state=True, package=pkg, **kw)
    g = torch.Generator(device="cpu").manual_seed(1)
    do = torch.randn(o.shape, generator=g).to(dev, o.dtype)
    dht = torch.randn(ht.shape, generator=g).to(dev, ht.dtype)
    torch.autograd.backward((o, ht), (do, dht))
    out[tag] = {"o": o, "ht": ht, **{f"d{n}": v.grad for n, v in x.items()}}

fwd_bwd("bounded_d64", x_of(2, 1024, 8, 64, 0), lower_bound=-0.61)
fwd_bwd("default_d64", x_of(2, 1024, 8, 64, 1))
fwd_bwd("bounded_d128", x_of(2, 512, 4, 128, 2), lower_bound=-0.61)
fwd_bwd("default_d128", x_of(2, 512, 4, 128, 3))
cu = torch.tensor([0, 100, 612, 1024, 2000], dtype=torch.int64, device=dev)
xv = x_of(1, 2000, 8, 64, 4, h0=False)
fwd_bwd("varlen_int64", xv, cu_seqlens=cu, lower_bound=-0.61)
with torch.inference_mode():
    s = x_of(1, 1, 32, 64, 5, grad=False)
    r, w, k, v, a, b, h0 = (s[n] for n in ("q", "gk", "k", "v", "a", "b", "initial_state"))
    gen = torch.Generator(device="cpu").manual_seed(2)
    kk, rate = -a, torch.rand(a.shape, generator=gen).to(dev, a.dtype)
    def step():
        return ops.fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=h0, output_final_state=True, package=pkg)
    def mul_step():
        return ops.fused_mul_recurrent_rwkv7(r, w, k, v, kk, rate, initial_state=h0, output_final_state=True,
                                             package=pkg)
    out["decode"] = dict(zip(("o", "ht"), step()))
    out["decode_mul"] = dict(zip(("o", "ht"), mul_step()))
    pool = torch.randn(6, 32, 64, 64, generator=gen).to(dev)
    sb = x_of(3, 1, 32, 64, 6, grad=False, h0=False)
    ops.fused_recurrent_rwkv7(sb["q"], sb["gk"], sb["k"], sb["v"], sb["a"], sb["b"], initial_state=pool,
                              ssm_state_indices=torch.tensor([4, 0, 2], dtype=torch.int32), package=pkg)
    out["pool"] = {"pool": pool}
    timing = {name: ms_per_call(fn, 200, 1000) for name, fn in (("decode_b1_ms", step), ("decode_mul_b1_ms", mul_step))}
xh = x_of(1, 4096, 2, 128, 7)
o, ht = ops.chunk_dplr_delta_rule(**xh, output_final_state=True, package=pkg, lower_bound=-0.61)
do, dht = torch.randn_like(o), torch.randn_like(ht)
def host_bound():
    o, ht = ops.chunk_dplr_delta_rule(**xh, output_final_state=True, package=pkg, lower_bound=-0.61)
    torch.autograd.backward((o, ht), (do, dht))
timing["fwd_bwd_1x4096x2x128_ms"] = ms_per_call(host_bound, 20, 100)
torch.save({t: {n: v.detach().cpu() for n, v in d.items()} for t, d in out.items()}, sys.argv[2])
paths = sorted({type(k).__name__ for ks in pkg._kernel_sets.values() for k in ks.aot.values()})
print("RESULT " + json.dumps({"timing_ms": timing, "kernel_classes": paths, "triton_imported": "triton" in sys.modules}))
"""


def child(package: str, mode: str, results: str) -> dict:
    env = dict(os.environ, DPLR_GEN_NO_JIT="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if mode == "triton":
        env["DPLR_GEN_KEEP_STUBS"] = "0"
    proc = subprocess.run([sys.executable, "-c", CHILD, package, results], env=env, text=True, capture_output=True,
                          timeout=400)
    res: dict = {"rc": proc.returncode}
    for ln in proc.stdout.splitlines():
        if ln.startswith("RESULT "):
            res.update(json.loads(ln[7:]))
    if proc.returncode:
        res["stderr"] = proc.stderr[-3000:]
    return res


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="direct-launch-"))
    runs = {}
    # alternated, twice each: host times move with the machine from process to process
    for i, mode in enumerate(("triton", "direct", "triton", "direct")):
        runs[f"{mode}_{i // 2}"] = child(args.package, mode, str(tmp / f"{mode}_{i // 2}.pt"))
    ok = all(r["rc"] == 0 for r in runs.values())
    same: dict[str, bool] = {}
    if ok:
        a, b = torch.load(tmp / "triton_0.pt"), torch.load(tmp / "direct_0.pt")
        for tag in a:
            for n in a[tag]:
                same[f"{tag}.{n}"] = bool(torch.equal(a[tag][n], b[tag][n]))
    direct_ok = ok and all(r["kernel_classes"] == ["DirectKernel"] and not r["triton_imported"]
                           for k, r in runs.items() if k.startswith("direct"))
    report = {"runs": runs, "bit_identical": same, "all_identical": bool(same) and all(same.values()),
              "direct_without_triton": direct_ok,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__}
    try:
        from importlib.metadata import version

        report["triton"] = version("triton")
    except Exception:  # noqa: BLE001
        pass
    dest = Path(os.environ.get("OUT", ".")) / "direct_launch_check.json"
    dest.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "bit_identical"}, indent=1))
    print("bit identical:", report["all_identical"], "direct without Triton:", direct_ok)
    return 0 if report["all_identical"] and direct_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

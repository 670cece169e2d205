"""On the GPU: the token pass alone for the bench's varlen case (16 mixed lengths, 32768 tokens, H = 32, D = 64),
the same tokens as 16 equal varlen sequences, and the 16 x 2048 dense twin: the built package's kernels
(persistent token pass) against session 21's units (JIT, a program per item), each through the driver.

    python varlen_tok.py generated/<package> DENSE_OLD_UNIT VARLEN_OLD_UNIT [NAME=VARLEN_UNIT ...]

NAME=UNIT: further units (JIT, persistent grid at 2 programs an SM): a path naming "varlen" on the varlen cases,
any other on the dense one.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from benchmarks import common as C  # noqa: E402
from dplr_gen import chunk_driver as drv  # noqa: E402
from dplr_gen import ops  # noqa: E402
from dplr_gen.compile import import_source  # noqa: E402
from dplr_gen.runtime import package_at  # noqa: E402


class JitSet:
    """A unit's kernels JIT-compiled, launched as the driver asks (residency unknown: a program per item)."""

    def __init__(self, module, resident=None):
        self.m, self.resident = module, resident

    def constexprs(self, name):
        return dict(self.m.CONSTEXPRS[name])

    def has(self, name):
        return name in self.m.SIGNATURES

    def option(self, name, default=None):
        return getattr(self.m, "OPTIONS", {}).get(name, default)

    def resident_per_sm(self, name, device):
        return self.resident

    def __getattr__(self, name):
        fn, c, lo = getattr(self.m, name), self.m.CONSTEXPRS[name], self.m.LAUNCH[name]

        class _G:
            def __getitem__(_, grid):
                return lambda *args: fn[grid](*args, **c, **lo)
        return _G()


def case(pkg, old, lengths, B, T, H, D=64, extra=()):
    dev, dtype = "cuda", torch.bfloat16
    varlen = lengths is not None
    name = ops._select(str(pkg.dir), "chunk", dtype, D, D, varlen, 16, -0.61, dtype)
    info = pkg.variants[name]
    ks = pkg.kernel_set(name, pkg.target_for(torch.device(dev)))
    x = C.rwkv7_case(B, T, H, D, dtype=dtype, device=dev, seed=7, n_states=len(lengths) if varlen else None)
    cu = C.cu_tensors(lengths, "int32", dev)[0] if varlen else None
    do, dht = C.grad_outputs(x, 7)
    o, ht, saved = drv.chunk_dplr_fwd(ks, info, x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 1.0, x["h0"], cu,
                                      keep_states=False)
    pr = drv.chunk_prep(ks, info, x["r"], x["k"], x["a"], x["b"], x["w"], cu, saved["n_slots"], for_bwd=True,
                        chunk_map=saved["chunk_map"])
    h, u = drv.chunk_states(ks, info, saved, pr)[:2]
    dh, dr = drv.chunk_dplr_bwd_dh(ks, info, saved, pr, do, dht)[:2]
    res = {}
    outs = {}
    for tag, kset in (("new", ks), ("old", JitSet(old)), *((n, JitSet(m, 2)) for n, m in extra)):
        f = lambda kset=kset: drv.chunk_dplr_bwd_tokens(kset, info, saved, h, u, do, dh, dr)  # noqa: E731
        outs[tag] = f()
        res[tag] = C.bench_ms(f, dev, warmup=10, rep=100)
    for tag in outs:
        res[f"diff_{tag}"] = max(float((a.double() - b.double()).norm() / b.double().norm())
                                 for a, b in zip(outs[tag], outs["old"]))
    return res


def dense_kernel_on_varlen_data(pkg, D=64):
    """The dense package's token pass on the equal-lengths varlen case's data, laid out as 16 x 2048 (the same
    bytes; the states of each sequence's unused 129th slot dropped): kernel against data."""
    dev, dtype = "cuda", torch.bfloat16
    lengths = (2048,) * 16
    name_v = ops._select(str(pkg.dir), "chunk", dtype, D, D, True, 16, -0.61, dtype)
    name_d = ops._select(str(pkg.dir), "chunk", dtype, D, D, False, 16, -0.61, dtype)
    kv = pkg.kernel_set(name_v, pkg.target_for(torch.device(dev)))
    kd = pkg.kernel_set(name_d, pkg.target_for(torch.device(dev)))
    x = C.rwkv7_case(1, 32768, 32, D, dtype=dtype, device=dev, seed=7, n_states=16)
    cu = C.cu_tensors(lengths, "int32", dev)[0]
    do, dht = C.grad_outputs(x, 7)
    info_v = pkg.variants[name_v]
    o, ht, saved = drv.chunk_dplr_fwd(kv, info_v, x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 1.0, x["h0"], cu,
                                      keep_states=False)
    pr = drv.chunk_prep(kv, info_v, x["r"], x["k"], x["a"], x["b"], x["w"], cu, saved["n_slots"], for_bwd=True,
                        chunk_map=saved["chunk_map"])
    h, u = drv.chunk_states(kv, info_v, saved, pr)[:2]
    dh, dr = drv.chunk_dplr_bwd_dh(kv, info_v, saved, pr, do, dht)[:2]
    keep = torch.tensor([s for s in range(16 * 129) if s % 129 != 128], device=dev)
    hd, dhd = h[keep].contiguous(), dh[keep].contiguous()
    dense = lambda t: t.view(16, 2048, *t.shape[2:])  # noqa: E731
    xd = C.rwkv7_case(16, 2048, 32, D, dtype=dtype, device=dev, seed=7)
    _, _, saved_d = drv.chunk_dplr_fwd(kd, pkg.variants[name_d], xd["r"], xd["k"], xd["v"], xd["a"], xd["b"],
                                       xd["w"], 1.0, xd["h0"], None, keep_states=False)
    for n, t in (("q", x["r"]), ("k", x["k"]), ("v", x["v"]), ("a", x["a"]), ("b", x["b"]), ("gk", x["w"])):
        saved_d[n] = dense(t)
    f_d = lambda: drv.chunk_dplr_bwd_tokens(kd, pkg.variants[name_d], saved_d, hd, dense(u), dense(do), dhd,  # noqa: E731
                                            dense(dr))
    f_v = lambda: drv.chunk_dplr_bwd_tokens(kv, info_v, saved, h, u, do, dh, dr)  # noqa: E731
    a, b = f_d(), f_v()
    diff = max(float((p.reshape(q.shape).double() - q.double()).norm() / q.double().norm()) for p, q in zip(a, b))
    return {"dense_kernel": C.bench_ms(f_d, dev, warmup=10, rep=100),
            "varlen_kernel": C.bench_ms(f_v, dev, warmup=10, rep=100), "diff": diff}


def main() -> None:
    if sys.argv[2] == "--kernel-vs-data":
        for rnd in range(2):
            print("equal lengths as dense", rnd, dense_kernel_on_varlen_data(package_at(sys.argv[1])), flush=True)
        return
    pkg = package_at(sys.argv[1])
    old_dense = import_source(Path(sys.argv[2]), "old_dense")
    old_varlen = import_source(Path(sys.argv[3]), "old_varlen")
    mixed = C.mixed_lengths(16, 32768, seed=0)
    extra = [(a.split("=")[0], import_source(Path(a.split("=")[1]), f"extra_{i}")) for i, a in enumerate(sys.argv[4:])]
    rows = {}
    for rnd in range(2):
        ev = [(n, m) for n, m in extra if "varlen" in m.__file__]
        ed = [(n, m) for n, m in extra if "varlen" not in m.__file__]
        for name, old, args, ex in (("varlen_mixed", old_varlen, (mixed, 1, 32768, 32), ev),
                                    ("varlen_equal", old_varlen, ((2048,) * 16, 1, 32768, 32), ev),
                                    ("dense16x2048", old_dense, (None, 16, 2048, 32), ed)):
            r = case(pkg, old, *args, extra=ex)
            rows.setdefault(name, []).append(r)
            print(name, rnd, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "varlen_tok.json").write_text(json.dumps({
        "package": sys.argv[1], "mixed_lengths": list(mixed), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

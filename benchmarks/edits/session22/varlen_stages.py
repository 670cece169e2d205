"""On the GPU: per-stage times of the backward (and the forward) for the bench's varlen case (16 sequences of
mixed lengths, 32768 tokens, H = 32, D = 64) and its 16-sequence dense twin (16 x 2048), from a built package;
the token pass also at one program per work item (the persistent kernel's grid as a plain launch would be).

    python varlen_stages.py generated/<package>
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
from dplr_gen.runtime import package_at  # noqa: E402


def stages(pkg, lengths, B, T, H, D=64):
    dev, dtype = "cuda", torch.bfloat16
    varlen = lengths is not None
    name = ops._select(str(pkg.dir), "chunk", dtype, D, D, varlen, 16, -0.61, dtype)
    info = pkg.variants[name]
    ks = pkg.kernel_set(name, pkg.target_for(torch.device(dev)))
    x = C.rwkv7_case(B, T, H, D, dtype=dtype, device=dev, seed=7, n_states=len(lengths) if varlen else None)
    cu = C.cu_tensors(lengths, "int32", dev)[0] if varlen else None
    do, dht = C.grad_outputs(x, 7)
    fwd_args = (x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 1.0, x["h0"], cu)
    o, ht, saved = drv.chunk_dplr_fwd(ks, info, *fwd_args, keep_states=False)
    pr = drv.chunk_prep(ks, info, x["r"], x["k"], x["a"], x["b"], x["w"], cu, saved["n_slots"], for_bwd=True,
                        chunk_map=saved["chunk_map"])
    h, u = drv.chunk_states(ks, info, saved, pr)[:2]
    dh, dr = drv.chunk_dplr_bwd_dh(ks, info, saved, pr, do, dht)[:2]
    plain = drv.persistent_launch
    fns = {
        "fwd": lambda: drv.chunk_dplr_fwd(ks, info, *fwd_args, keep_states=False),
        "prep_bwd": lambda: drv.chunk_prep(ks, info, x["r"], x["k"], x["a"], x["b"], x["w"], cu, saved["n_slots"],
                                           for_bwd=True, chunk_map=saved["chunk_map"]),
        "states": lambda: drv.chunk_states(ks, info, saved, pr),
        "bwd_dh": lambda: drv.chunk_dplr_bwd_dh(ks, info, saved, pr, do, dht),
        "bwd": lambda: drv.chunk_dplr_bwd_tokens(ks, info, saved, h, u, do, dh, dr),
    }
    ms = {st: C.bench_ms(f, dev, warmup=10, rep=100) for st, f in fns.items()}
    drv.persistent_launch = lambda ks_, name_, n, device: (n, [n] if name_ in ks_.option("persistent", ()) else [])
    try:
        ms["bwd_one_per_item"] = C.bench_ms(fns["bwd"], dev, warmup=10, rep=100)
    finally:
        drv.persistent_launch = plain
    grid, _ = drv.persistent_launch(ks, drv.BWD, saved["n_tslots"] * H, torch.device(dev))
    return {"variant": name, "n_items": saved["n_tslots"] * H, "grid": grid, "ms": ms}


def main() -> None:
    pkg = package_at(sys.argv[1])
    lengths = C.mixed_lengths(16, 32768, seed=0)
    rows = {}
    for rnd in range(2):
        for case, args in (("varlen", (lengths, 1, 32768, 32)), ("dense16x2048", (None, 16, 2048, 32))):
            r = stages(pkg, *args)
            rows.setdefault(case, []).append(r)
            print(case, rnd, r["variant"], "items", r["n_items"], "grid", r["grid"],
                  {k: round(v, 3) for k, v in r["ms"].items()}, flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "varlen_stages.json").write_text(json.dumps({
        "package": sys.argv[1], "lengths": list(lengths), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Upper bound of running the reverse pass beside the token pass (keep mode): each alone, one after the other,
and both at once on two streams (the token pass reading a dh computed before: timing only). H100, bf16, RWKV-7 inputs, bound -0.61.

    python benchmarks/edits/session19/overlap_bound.py generated/<package>    (GPU machine, repo root)
"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from benchmarks import common as C
from dplr_gen import chunk_driver as drv, ops
from dplr_gen.runtime import package_at

dev, dtype = "cuda", torch.bfloat16
pkg = package_at(sys.argv[1] if len(sys.argv) > 1 else "generated/hopper")
rows = []
for (B, T, H, D) in [(8, 4096, 64, 64), (4, 4096, 32, 64), (8, 2048, 16, 128)]:
    name = ops._select(str(pkg.dir), "chunk", dtype, D, D, False, 16, C.GATE_BOUND, dtype)
    info = pkg.variants[name]
    ks = pkg.kernel_set(name, pkg.target_for(torch.device(dev)))
    x = C.rwkv7_case(B, T, H, D, dtype=dtype, device=dev, seed=7)
    x["w"] = x["w"].to(ops.TORCH_DTYPES[info.gate_dtype])
    fwd_args = (x["r"], x["k"], x["v"], x["a"], x["b"], x["w"], 1.0, x["h0"], None)
    o, ht, saved = drv.chunk_dplr_fwd(ks, info, *fwd_args, keep_states=True, prep_for_bwd=True)
    do, dht = C.grad_outputs(x, 7)
    pr = saved.pop("prep")
    dh, dr = drv.chunk_dplr_bwd_dh(ks, info, saved, pr, do, dht)[:2]
    h, u = saved["states"]
    steps = drv.state_step_operands(pr) if drv.derives_states(ks) else ()
    side = torch.cuda.Stream()
    def rev(): drv.chunk_dplr_bwd_dh(ks, info, saved, pr, do, dht)
    def tok(): drv.chunk_dplr_bwd_tokens(ks, info, saved, h, u, do, dh, dr, steps=steps)
    def seq(): rev(); tok()
    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            rev()
        tok()
        torch.cuda.current_stream().wait_stream(side)
    def full(): drv.chunk_dplr_bwd(ks, info, dict(saved, prep=pr), do, dht)
    r = {"shape": [B, T, H, D]}
    for k, f in {"rev": rev, "tok": tok, "seq": seq, "both": both}.items():
        f(); torch.cuda.synchronize()
        r[k] = [round(C.bench_ms(f, dev, warmup=10, rep=100), 4) for _ in range(2)]
    print(r, flush=True)
    rows.append(r)
Path(os.environ.get("OUT", ".")).joinpath("overlap_bound.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))

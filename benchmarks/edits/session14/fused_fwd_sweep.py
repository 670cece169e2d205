"""Session 14: how fast is the sequential (fused recurrent) forward at the training shapes, per tile and warps?"""
import json, os, sys, itertools
from pathlib import Path
import torch, triton
sys.path.insert(0, os.getcwd())
from dplr_gen.compile import import_source

out = Path(os.environ.get("OUT", "out")); out.mkdir(parents=True, exist_ok=True)
rows = []
for K, shape in ((64, (8, 4096, 64)), (64, (4, 4096, 32)), (128, (8, 2048, 16)), (128, (1, 4096, 2))):
    unit = Path(f"generated/hopper/fused_recurrent_bf16_k{K}_v{K}_dense_gany_gfp32_sfp32/sm_90.py")
    mod = import_source(unit, f"fu{K}")
    name = "fused_recurrent_dplr_fwd_kernel"
    fn = getattr(mod, name)
    B, T, H = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g, device="cuda") * sc).to(torch.bfloat16)
    q, k, v = r(B, T, H, K, sc=0.5), r(B, T, H, K, sc=0.5), r(B, T, H, K)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, device="cuda"), dim=-1)
    a, b = (-kk).to(torch.bfloat16), (kk * 0.5).to(torch.bfloat16)
    gk = -torch.rand(B, T, H, K, generator=g, device="cuda") * 0.6
    o = torch.empty_like(v); h0 = torch.randn(B * H, K, K, device="cuda") * 0.1 if False else torch.randn(B, H, K, K, device="cuda") * 0.1
    ht = torch.empty_like(h0)
    for BV, warps in itertools.product((4, 8, 16, 32, 64), (1, 2, 4)):
        if BV > K: continue
        grid = (B * H, triton.cdiv(K, BV))
        def run():
            fn[grid](q, k, v, a, b, gk, o, h0, ht, K ** -0.5, T, H, K=K, V=K, BK=K, BV=BV, num_warps=warps, num_stages=2)
        try:
            run(); torch.cuda.synchronize()
            ms = triton.testing.do_bench(run, warmup=10, rep=50)
        except Exception as e:
            ms = None; print(e)
        rows.append({"K": K, "shape": shape, "BV": BV, "warps": warps, "ms": ms})
        print(K, shape, BV, warps, ms, flush=True)
(out / "fused_fwd_times.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, indent=1))

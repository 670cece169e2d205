"""On the GPU: dense token-pass units launched directly at the persistent grid on the same random inputs: the
dense unit as is against forms that locate their items otherwise (an extra trailing argument ``rows``: a per-slot
table of (first token, rows), built here). Outputs compared with the first unit's.

    python direct_dense.py UNIT [NAME=UNIT ...] --shape 16x2048x32
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from dplr_gen.compile import import_source  # noqa: E402
from time_token_edits import OUTPUTS, inputs  # noqa: E402

KERNEL = "chunk_dplr_bwd_kernel"
B, T, H = (int(x) for x in sys.argv[-1].split("x"))
units = [("dense", import_source(Path(sys.argv[1]), "u0"))]
units += [(a.split("=")[0], import_source(Path(a.split("=")[1]), f"u{i + 1}")) for i, a in enumerate(sys.argv[2:-1])]
base = units[0][1]
sig, c, lo = base.SIGNATURES[KERNEL], base.CONSTEXPRS[KERNEL], base.LAUNCH[KERNEL]
xs = inputs(sig, B, T, H, c["K"], c["BC"])
n_items = xs[-1]
NT = triton.cdiv(T, 16)
slots = torch.arange(B * NT, device="cuda")
rows = torch.stack([(slots // NT) * T + (slots % NT) * 16, torch.clamp(T - (slots % NT) * 16, max=16)], 1)
rows = rows.to(torch.int32).contiguous()
grid = (min(n_items, 2 * torch.cuda.get_device_properties(0).multi_processor_count),)
outs = {n: x for n, x in zip(sig, xs) if n in OUTPUTS["bwd"]}
ref = None
for rnd in range(2):
    for name, m in units:
        extra = [rows] if "rows" in m.chunk_dplr_bwd_kernel.arg_names else []
        run = lambda m=m, extra=extra: m.chunk_dplr_bwd_kernel[grid](*xs, *extra, **c, **lo)  # noqa: E731
        if rnd == 0:
            for x in outs.values():
                x.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            got = {n: x.clone() for n, x in outs.items()}
            ref = ref or got
            diff = max(float((got[n].double() - ref[n].double()).norm() / ref[n].double().norm()) for n in got)
            print(name, "diff", diff, "nan", sum(int(torch.isnan(x).sum()) for x in got.values()), flush=True)
        print(sys.argv[-1], rnd, name, round(triton.testing.do_bench(run, warmup=25, rep=200), 4), "ms", flush=True)

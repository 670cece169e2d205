"""Quick GPU probe of the chunk op through the JIT path: accuracy vs float64 and timings (development aid).

python scripts/chunk_probe.py  -> prints a table, writes $OUT/chunk_probe.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dplr_gen import build as b  # noqa: E402
from dplr_gen import ops  # noqa: E402
from dplr_gen.reference import naive_dplr_delta_rule  # noqa: E402
from dplr_gen.runtime import package_at  # noqa: E402
from dplr_gen.testing import rel_err, rwkv7_inputs  # noqa: E402

SPEC = """
name: probe
targets: [{target}]
variants:
  - ops: [chunk]
    dtypes: [bf16]
    head_dims: [64, 128]
    chunk_sizes: [{chunks}]
    varlen: [false]
    gate_bounds: [-0.61]
  - ops: [chunk]
    dtypes: [bf16]
    head_dims: [64]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [null]
"""


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major * 10 + minor}"
    chunks = os.environ.get("CHUNKS", "64")
    tmp = Path(tempfile.mkdtemp())
    spec = tmp / "probe.yaml"
    spec.write_text(SPEC.format(target=target, chunks=chunks))
    p = b.plan(spec, tmp / "gen")
    b.write_package(p)
    pkg = package_at(p.out_dir)
    res: dict = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    names = ("q", "k", "v", "a", "b", "gk", "initial_state")
    for D, lb in ((64, -0.61), (64, None), (128, -0.61)):
        row: dict = {"D": D, "lower_bound": lb}
        try:
            # accuracy at B=2, T=1024, H=2
            x = rwkv7_inputs(2, 1024, 2, D, dtype=torch.bfloat16, device="cuda")
            xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
            t0 = time.perf_counter()
            o, ht = ops.chunk_dplr_delta_rule(**xs, output_final_state=True, lower_bound=lb, package=pkg)
            do, dht = torch.randn_like(o), torch.randn_like(ht)
            ((o * do).sum() + (ht * dht).sum()).backward()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            x64 = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
            ro, rht = naive_dplr_delta_rule(**x64, output_final_state=True)
            ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
            row["err"] = {"o": rel_err(o, ro), "ht": rel_err(ht, rht)}
            row["err"].update({f"d{n}": rel_err(xs[n].grad, x64[n].grad) for n in names})
            # timing at (4, 4096, 32, D) or (8, 2048, 16, 128)
            B, T, H = (4, 4096, 32) if D == 64 else (8, 2048, 16)
            x = rwkv7_inputs(B, T, H, D, dtype=torch.bfloat16, device="cuda")
            xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
            fwd = lambda: ops.chunk_dplr_delta_rule(**xs, output_final_state=True, lower_bound=lb, package=pkg)
            o, ht = fwd()
            do, dht = torch.randn_like(o), torch.randn_like(ht)

            def fwdbwd():
                o, ht = fwd()
                torch.autograd.backward((o, ht), (do, dht))

            row["shape"] = [B, T, H, D]
            row["fwd_ms"] = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
            row["fwdbwd_ms"] = triton.testing.do_bench(fwdbwd, warmup=25, rep=100, return_mode="median")
        except Exception as e:  # record, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    (out / "chunk_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

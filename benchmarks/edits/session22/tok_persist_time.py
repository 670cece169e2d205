"""On the GPU: the token pass of an old unit (a program per item) against a unit whose token pass is persistent
(grid = programs resident per SM, from the JIT-compiled kernel's registers and shared memory, times the SMs),
on the same inputs: outputs compared (NaN-poisoned first), then do_bench medians, alternating rounds.

    python tok_persist_time.py OLD_UNIT NEW_UNIT --shapes 8x4096x64,4x4096x32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from dplr_gen.compile import import_source  # noqa: E402
from dplr_gen.runtime import blocks_per_sm  # noqa: E402
from time_token_edits import OUTPUTS, inputs  # noqa: E402

KERNEL = "chunk_dplr_bwd_kernel"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--shapes", default="8x4096x64,4x4096x32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    old, new = import_source(args.old, "unit_old"), import_source(args.new, "unit_new")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    rows = []
    for shape in args.shapes.split(","):
        B, T, H = (int(x) for x in shape.split("x"))
        c = new.CONSTEXPRS[KERNEL]
        sig = new.SIGNATURES[KERNEL]
        xs = inputs(sig, B, T, H, c["K"], c["BC"])
        n_items = B * triton.cdiv(T, c["BC"]) * H
        outs = {n: x for n, x in zip(sig, xs) if n in OUTPUTS["bwd"]}
        fo, fn = old.chunk_dplr_bwd_kernel, new.chunk_dplr_bwd_kernel
        lo, ln = old.LAUNCH[KERNEL], new.LAUNCH[KERNEL]
        k = fn[(n_items,)](*xs, **c, **ln)  # compiled once at one program per item, for its resources
        torch.cuda.synchronize()
        k._init_handles()
        resident = blocks_per_sm(k.n_regs, k.metadata.shared, ln["num_warps"],
                                 regs_sm=props.regs_per_multiprocessor,
                                 smem_sm=props.shared_memory_per_multiprocessor,
                                 threads_sm=props.max_threads_per_multi_processor)
        grid = min(n_items, resident * sms)
        runs = {"old": lambda: fo[(n_items,)](*xs[:-1], **c, **lo),
                "new": lambda: fn[(grid,)](*xs, **c, **ln)}
        ref = None
        row = {"shape": shape, "n_items": n_items, "grid": grid, "resident_per_sm": resident,
               "n_regs": k.n_regs, "shared": k.metadata.shared, "ms": {"old": [], "new": []}, "vs_old": {}}
        for name, run in runs.items():
            for x in outs.values():
                x.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = {n: x.clone() for n, x in outs.items()}
            else:
                for n, x in outs.items():
                    d = x.double() - ref[n].double()
                    row["vs_old"][n] = {"nan": int(torch.isnan(x).sum()),
                                        "rel_norm": float(d.norm() / ref[n].double().norm())}
        print(shape, "grid", grid, "resident", resident, "regs", k.n_regs, "shared", k.metadata.shared,
              {n: ("%.1e" % v["rel_norm"], v["nan"]) for n, v in row["vs_old"].items()}, flush=True)
        for r in range(args.rounds):
            for name, run in runs.items():
                ms = triton.testing.do_bench(run, warmup=25, rep=200)
                row["ms"][name].append(round(ms, 4))
                print(f"{shape} round {r} {name}: {ms:.4f} ms", flush=True)
        rows.append(row)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    tag = args.new.parent.name
    (out / f"tok_persist_{tag}.json").write_text(json.dumps({
        "old": str(args.old), "new": str(args.new), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

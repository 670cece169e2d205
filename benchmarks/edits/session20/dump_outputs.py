"""Session 20: o, ht and every input gradient of dplr-gen's chunk_rwkv7 (dplr-fast and dplr-keep) for fixed-seed
RWKV-7 bf16 inputs, saved to one .pt file, so that two source trees' packages can be compared bit for bit
(run once per tree, then ``--compare A.pt B.pt``).

    python dump_outputs.py --package generated/NAME --out FILE.pt [--shapes 2x4096x4x64,...]
    python dump_outputs.py --compare A.pt B.pt
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the tree the caller runs from (base or candidate), not this file's


def dump(package: str, out: str, shapes: list[str], device: str = "cuda") -> None:
    import torch

    from benchmarks import common as C

    res: dict[str, torch.Tensor] = {}
    for text in shapes:
        B, T, H, D = (int(p) for p in text.split("x"))
        dtype = torch.bfloat16
        x = C.rwkv7_case(B, T, H, D, dtype=dtype, device=device, seed=1234)
        do, dht = C.grad_outputs(x, 1234)
        for name in ("dplr-fast", "dplr-keep"):
            op, _ = C.load_op(C.SYSTEMS[name], package)
            for rnd in range(2):  # the second call reuses the allocator's (now dirty) blocks
                got = C.fwd_bwd(op, C.leaves(x), do, dht)
                for q, t in got.items():
                    res[f"{text}/{name}/{rnd}/{q}"] = t.detach().cpu()
    torch.save(res, out)
    print(f"saved {len(res)} tensors to {out}")


def compare(a: str, b: str) -> int:
    import torch

    ta, tb = torch.load(a), torch.load(b)
    bad = 0
    for k in sorted(set(ta) | set(tb)):
        if k not in ta or k not in tb:
            print(f"MISSING {k}")
            bad += 1
            continue
        same = torch.equal(ta[k], tb[k])
        if not same:
            diff = (ta[k].double() - tb[k].double()).abs().max().item()
            print(f"DIFF {k}: max abs {diff:.3e}")
            bad += 1
    print(f"{len(ta)} tensors compared, {bad} differ" + ("" if bad else ": all bit-identical"))
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--package")
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="2x4096x4x64,2x2048x4x128,1x333x3x64")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    dump(args.package, args.out, args.shapes.split(","), args.device)

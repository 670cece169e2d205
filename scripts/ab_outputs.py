"""Bit-for-bit A/B of two source trees: o, ht and every input gradient of dplr-gen's chunk_rwkv7 (dplr-fast and
dplr-keep, two calls each, the second on the allocator's used blocks) for fixed-seed RWKV-7 inputs, saved to one
file per tree, then compared. A layout or order change that should not move a bit is checked this way before
it is timed (scripts/ab_gpu.sh runs it on both trees).

    python scripts/ab_outputs.py --package generated/NAME --out FILE.pt [--shapes 2x4096x4x64,...] [--dtype bf16]
    python scripts/ab_outputs.py --compare A.pt B.pt      # exit 1 if any tensor differs or is missing

The dump imports dplr_gen and benchmarks from the current folder (the tree under test), not from this file's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

def dump(package: str, out: str, shapes: list[str], device: str = "cuda", dtype: str = "bf16") -> int:
    """Run both systems on every shape and save every output under '<shape>/<system>/<call>/<quantity>'."""
    import torch

    from benchmarks import common as C
    from dplr_gen.ops import DTYPE_NAMES

    by_name = {n: t for t, n in DTYPE_NAMES.items()}
    if dtype not in by_name:
        raise SystemExit(f"--dtype {dtype!r}: give one of {', '.join(by_name)}")
    tdtype = by_name[dtype]
    res: dict[str, torch.Tensor] = {}
    for text in shapes:
        sh = C.parse_shape(text, {})
        x = C.rwkv7_case(sh.B, sh.T, sh.H, sh.D, dtype=tdtype, device=device, seed=1234)
        do, dht = C.grad_outputs(x, 1234)
        for name in ("dplr-fast", "dplr-keep"):
            op, _ = C.load_op(C.SYSTEMS[name], package)
            for call in range(2):
                got = C.fwd_bwd(op, C.leaves(x), do, dht)
                for q, t in got.items():
                    res[f"{text}/{name}/{call}/{q}"] = t.detach().cpu()
    torch.save(res, out)
    print(f"saved {len(res)} tensors to {out}")
    return len(res)


def compare(a: str, b: str) -> int:
    """Print every tensor that differs (with its largest difference) or is missing; 0 if all are identical."""
    import torch

    ta, tb = torch.load(a), torch.load(b)
    bad = 0
    for k in sorted(set(ta) | set(tb)):
        if k not in ta or k not in tb:
            print(f"MISSING {k} in {b if k in ta else a}")
            bad += 1
        elif not torch.equal(ta[k], tb[k]):
            diff = (ta[k].double() - tb[k].double()).abs().max().item()
            print(f"DIFF {k}: max abs {diff:.3e}")
            bad += 1
    print(f"{len(set(ta) | set(tb))} tensors compared, {bad} differ" + ("" if bad else ": all bit-identical"))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", help="the built package to dump (relative to the current folder)")
    ap.add_argument("--out", help="file to save the outputs to")
    ap.add_argument("--shapes", default="2x4096x4x64,2x2048x4x128,1x333x3x64", help="comma list of BxTxHxD")
    ap.add_argument("--dtype", default="bf16", help="the inputs' dtype: bf16, fp16 or fp32")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved files instead")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not (args.package and args.out):
        ap.error("--package and --out are required unless --compare is given")
    dump(args.package, args.out, args.shapes.split(","), args.device, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())

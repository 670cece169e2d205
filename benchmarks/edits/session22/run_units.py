"""On the GPU: one kernel of several generated units (e.g. the shipped unit's Triton token pass and a rebuilt
unit's Gluon one) on the same random inputs: outputs poisoned with NaN before each unit's first run and compared
with the first unit's, then do_bench medians in alternating rounds.

    python run_units.py NAME=UNIT[@triton] NAME=UNIT ... --shapes 2x1000x4,8x2048x16 [--kernel ...]

``@triton`` runs the unit's Triton form of a Gluon kernel (its TRITON_FORMS table) at the unit's launch knobs.
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
from time_token_edits import OUTPUTS, inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("units", nargs="+")
    ap.add_argument("--shapes", default="2x1000x4,8x2048x16")
    ap.add_argument("--kernel", default="chunk_dplr_bwd_kernel")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="units")
    args = ap.parse_args()
    forms = []
    for i, spec in enumerate(args.units):
        name, _, path = spec.partition("=")
        path, _, form = path.partition("@")
        unit = import_source(Path(path), f"unit_{i}")
        fn = unit.TRITON_FORMS[args.kernel] if form == "triton" else getattr(unit, args.kernel)
        forms.append((name, path, unit, fn))
    sig = forms[0][2].SIGNATURES[args.kernel]
    rows = []
    for shape in args.shapes.split(","):
        B, T, H = (int(x) for x in shape.split("x"))
        c0 = forms[0][2].CONSTEXPRS[args.kernel]
        xs = inputs(sig, B, T, H, c0["K"], c0["BC"])
        outs = {n: x for n, x in zip(sig, xs) if n in OUTPUTS["bwd"]}
        ref = None
        runs = {}
        for name, path, unit, fn in forms:
            if unit.SIGNATURES[args.kernel] != sig:
                raise SystemExit(f"{name}: signature differs from {forms[0][0]}'s")
            consts, launch = unit.CONSTEXPRS[args.kernel], dict(unit.LAUNCH[args.kernel])
            grid = (B * triton.cdiv(T, consts["BC"]) * H * triton.cdiv(consts["K"], consts["BK"]),)

            def run(fn=fn, consts=consts, launch=launch, grid=grid):
                fn[grid](*xs, **consts, **launch)
            for x in outs.values():
                x.fill_(float("nan"))
            try:
                run()
                torch.cuda.synchronize()
            except Exception as ex:  # noqa: BLE001 - report and go on with the other units
                print(f"{shape} {name}: FAILED {type(ex).__name__}: {str(ex)[-600:]}", flush=True)
                rows.append({"shape": shape, "unit": name, "error": str(ex)[-600:]})
                continue
            cmp = {}
            if ref is None:
                ref = {n: x.clone() for n, x in outs.items()}
            for n, x in outs.items():
                d = x.double() - ref[n].double()
                cmp[n] = {"nan": int(torch.isnan(x).sum()), "max_abs": float(d.abs().max()),
                          "rel_norm": float(d.norm() / ref[n].double().norm())}
            runs[name] = run
            rows.append({"shape": shape, "unit": name, "path": path, "launch": launch, "constexprs": consts,
                         "grid": grid[0], "vs_first": cmp, "ms": []})
            print(f"{shape} {name}: " + " ".join(f"{n}={v['rel_norm']:.1e}/nan{v['nan']}" for n, v in cmp.items()),
                  flush=True)
        if B * T * H < 2 ** 17:
            continue  # a correctness shape only
        for r in range(args.rounds):
            for row in rows:
                if row["shape"] == shape and row["unit"] in runs:
                    ms = triton.testing.do_bench(runs[row["unit"]], warmup=25, rep=200)
                    row["ms"].append(round(ms, 4))
                    print(f"{shape} round {r} {row['unit']}: {ms:.4f} ms", flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps({
        "kernel": args.kernel, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

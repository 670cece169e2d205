"""On the GPU: the shipped K = 64 token pass against Gluon forms of it, on the same random inputs: outputs
(poisoned with NaN before each form's first run) compared with the shipped form's, then do_bench medians.

    python run_tok.py UNIT_SOURCE GLUON_FILE --shapes 8x4096x64,4x4096x32 --forms name:fn:warps:maxnreg,...
"""
from __future__ import annotations

import argparse
import importlib.util
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

KERNEL = "chunk_dplr_bwd_kernel"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("unit", type=Path)
    ap.add_argument("gluon", type=Path)
    ap.add_argument("--shapes", default="2x1000x4,8x4096x64,4x4096x32")
    ap.add_argument("--forms", default="g4:token_pass_gluon:4:0,g4c168:token_pass_gluon:4:168")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    unit = import_source(args.unit, "unit_shipped")
    spec = importlib.util.spec_from_file_location("gluon_forms", args.gluon)
    gm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gm)
    sig, consts, launch = unit.SIGNATURES[KERNEL], unit.CONSTEXPRS[KERNEL], unit.LAUNCH[KERNEL]
    forms = [("shipped", getattr(unit, KERNEL), dict(launch))]
    if KERNEL in getattr(unit, "TRITON_FORMS", {}):
        # the unit ships the Gluon kernel: its Triton form (as shipped before, at 168 registers) is the reference
        forms.insert(0, ("triton_form", unit.TRITON_FORMS[KERNEL], {**launch, "maxnreg": 168}))
    for f in args.forms.split(","):
        name, fn, warps, reg = f.split(":")
        lo = {"num_warps": int(warps)}
        if int(reg):
            lo["maxnreg"] = int(reg)
        forms.append((name, getattr(gm, fn), lo))
    rows = []
    for shape in args.shapes.split(","):
        B, T, H = (int(x) for x in shape.split("x"))
        xs = inputs(sig, B, T, H, consts["K"], consts["BC"])
        grid = (B * triton.cdiv(T, consts["BC"]) * H,)
        outs = {n: x for n, x in zip(sig, xs) if n in OUTPUTS["bwd"]}
        ref = None
        runs = {}
        for name, fn, lo in forms:
            def run(fn=fn, lo=lo):
                fn[grid](*xs, **consts, **lo)
            for x in outs.values():
                x.fill_(float("nan"))
            try:
                run()
                torch.cuda.synchronize()
            except Exception as ex:  # noqa: BLE001
                print(f"{shape} {name}: FAILED {type(ex).__name__}: {str(ex)[-400:]}", flush=True)
                rows.append({"shape": shape, "form": name, "error": str(ex)[-400:]})
                continue
            cmp = {}
            if ref is None:
                ref = {n: x.clone() for n, x in outs.items()}
            else:
                for n, x in outs.items():
                    d = (x.double() - ref[n].double())
                    cmp[n] = {"nan": int(torch.isnan(x).sum()), "max_abs": float(d.abs().max()),
                              "rel_norm": float(d.norm() / ref[n].double().norm())}
            runs[name] = run
            rows.append({"shape": shape, "form": name, "launch": lo, "vs_shipped": cmp, "ms": []})
            print(f"{shape} {name}: {json.dumps(cmp)}", flush=True)
        if B * T * H < 2 ** 18:
            continue  # correctness shape only
        for r in range(args.rounds):
            for row in rows:
                if row["shape"] == shape and row["form"] in runs:
                    ms = triton.testing.do_bench(runs[row["form"]], warmup=25, rep=200)
                    row["ms"].append(round(ms, 4))
                    print(f"{shape} round {r} {row['form']}: {ms:.4f} ms", flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gluon_token.json").write_text(json.dumps({
        "unit": str(args.unit), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

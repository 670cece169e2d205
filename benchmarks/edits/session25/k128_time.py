"""On the GPU: the shipped K = 128 deriving token pass (Triton, a program per work item) against the session-25
persistent Gluon prototype (k128_persist_unit.py) on the same random inputs: outputs compared (NaN-poisoned
first), then do_bench medians in alternating rounds.

    python k128_time.py [--unit NEW.py | --form NAME] [--shapes 8x2048x16,2x1000x4] [--rounds 3] [--tag NAME]

--form: the prototype under the text edits of forms.json (each form's edits applied after those of the form it
names in "after"): cc_first (the four [C, C] products before the step: the shipped order), item_early,
item_early2, item_early3 (perf_notes 52).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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
SHIPPED = ROOT / "generated/hopper/chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py"
HERE = Path(__file__).resolve().parent


def form_source(name: str) -> str:
    """The prototype's source under form ``name`` of forms.json (its "after" chain first; every text must occur
    exactly once, so that an edit never silently matches nothing)."""
    forms = json.loads((HERE / "forms.json").read_text())
    chain = []
    while name:
        chain.append(name)
        name = forms[name]["after"]
    text = (HERE / "k128_persist_unit.py").read_text()
    for form in reversed(chain):
        for old, new in forms[form]["replace"]:
            if text.count(old) != 1:
                raise SystemExit(f"form {form}: text found {text.count(old)} times: {old[:80]!r}")
            text = text.replace(old, new)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unit", type=Path, default=HERE / "k128_persist_unit.py")
    ap.add_argument("--form", help="a form of forms.json instead of --unit")
    ap.add_argument("--shapes", default="2x1000x4,1x48x1,8x2048x16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default="s25")
    args = ap.parse_args()
    if args.form:  # Gluon reads a kernel's source from its file: the form is written to one
        args.unit = Path(tempfile.mkdtemp()) / f"k128_persist_unit_{args.form}.py"
        args.unit.write_text(form_source(args.form))
    old, new = import_source(SHIPPED, "unit_old"), import_source(args.unit, "unit_new")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    rows = []
    for shape in args.shapes.split(","):
        B, T, H = (int(x) for x in shape.split("x"))
        c = new.CONSTEXPRS[KERNEL]
        sig = new.SIGNATURES[KERNEL]
        xs = inputs(sig, B, T, H, c["K"], c["BC"])
        n_items = B * triton.cdiv(T, c["BC"]) * H * (c["K"] // c["BK"])
        xs[list(sig).index("n_items")] = n_items
        outs = {n: x for n, x in zip(sig, xs) if n in OUTPUTS["bwd"]}
        # the shipped unit's Triton form (since session 25 the unit's chunk_dplr_bwd_kernel is the Gluon kernel,
        # its Triton form kept as TRITON_FORMS, taking n_items too)
        forms = getattr(old, "TRITON_FORMS", {})
        fo, fn = forms.get(KERNEL, old.chunk_dplr_bwd_kernel), new.chunk_dplr_bwd_kernel
        old_args = xs if KERNEL in forms else xs[:-1]
        lo, ln = old.LAUNCH[KERNEL], new.LAUNCH[KERNEL]
        k = fn[(1,)](*xs, **c, **ln)
        torch.cuda.synchronize()
        k._init_handles()
        resident = blocks_per_sm(k.n_regs, k.metadata.shared, ln["num_warps"],
                                 regs_sm=props.regs_per_multiprocessor,
                                 smem_sm=props.shared_memory_per_multiprocessor,
                                 threads_sm=props.max_threads_per_multi_processor)
        grid = min(n_items, resident * sms)
        runs = {"old": lambda: fo[(n_items,)](*old_args, **c, **lo),
                "new": lambda: fn[(grid,)](*xs, **c, **ln),
                "new_per_item": lambda: fn[(n_items,)](*xs, **c, **ln)}
        ref = None
        row = {"shape": shape, "n_items": n_items, "grid": grid, "resident_per_sm": resident, "n_regs": k.n_regs,
               "n_spills": getattr(k, "n_spills", None), "shared": k.metadata.shared,
               "ms": {"old": [], "new": []}, "vs_old": {}}
        for name, run in runs.items():
            for x in outs.values():
                x.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = {n: x.clone() for n, x in outs.items()}
                continue
            row["vs_old"][name] = {}
            for n, x in outs.items():
                d = x.double() - ref[n].double()
                row["vs_old"][name][n] = {"nan": int(torch.isnan(x).sum()),
                                          "rel_norm": float(d.norm() / ref[n].double().norm()),
                                          "max_abs": float(d.abs().max())}
        print(shape, "grid", grid, "resident", resident, "regs", k.n_regs, "spills", row["n_spills"], "shared",
              k.metadata.shared, flush=True)
        for name, d in row["vs_old"].items():
            print("  ", name, {n: ("%.1e" % v["rel_norm"], v["nan"]) for n, v in d.items()}, flush=True)
        for r in range(args.rounds):
            for name in ("old", "new"):
                ms = triton.testing.do_bench(runs[name], warmup=25, rep=200)
                row["ms"][name].append(round(ms, 4))
                print(f"{shape} round {r} {name}: {ms:.4f} ms", flush=True)
        rows.append(row)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"k128_persist_{args.tag}.json").write_text(json.dumps({
        "unit": str(args.unit), "form": args.form, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

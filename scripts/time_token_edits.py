"""Time the token pass (chunk_dplr_bwd_kernel) of one generated unit as shipped and under edits, on the GPU; or
(--kernel prep, prep_bwd) one of its chunk-parallel preps.

    python scripts/time_token_edits.py generated/hopper/<unit>/sm_90.py --shape 4x4096x32 [--edits FILE.json]
                                       [--kernel bwd|prep|prep_bwd] [--switch store_fwd_ops=1]

An edit is a launch-option override ({"launch": {"maxnreg": 168}}), a constexpr override ({"consts": {"BV": 64}}),
a grid G times smaller ({"grid_div": G}: a form whose programs each take G items), arguments passed as host-side
TMA descriptors ({"desc": {"q": ["btc", [1, 16, 64]]}}, see as_descriptor) and/or text replacements in
the unit's source ({"replace": [[old, new], ...]}): ablations (a part of the kernel removed, to see what it costs) and candidates
alike. Each form is JIT-compiled from its own copy of the source and timed with triton.testing.do_bench on the
same random bf16 inputs (never zeros); the medians, registers and spills Triton reports go to stdout and to
$OUT/token_edits_<shape>.json (<kernel>_edits_<shape>.json for another kernel). Ablated forms compute wrong
gradients: their times say where the time goes, nothing more. Each form's outputs are poisoned (NaN) before its
first run and then compared with the shipped form's (`max_abs_diff_vs_shipped`; NaN where an element was not
written): a candidate must match the shipped form, an ablation need not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dplr_gen.compile import import_source  # noqa: E402
from dplr_gen.runtime import _set_torch_allocator  # noqa: E402

# the kernels this script can launch: each is one program per chunk slot and head (times K blocks for the token pass)
KERNELS = {"bwd": "chunk_dplr_bwd_kernel", "prep": "chunk_dplr_prep_kernel", "prep_bwd": "chunk_dplr_prep_bwd_kernel"}

DTYPES = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32}
# what each kernel writes (compared with the shipped form's)
OUTPUTS = {"bwd": frozenset({"dq", "dk", "da", "db", "dg"}),
           "prep": frozenset({"w", "m", "bwt", "kwt", "egc", "aqk", "aqb", "qw"}),
           "prep_bwd": frozenset({"w", "m", "bwt", "kwt", "egc", "y", "p", "qwt", "awt", "aqkt", "aakt", "aqk", "aqb",
                                  "qw"})}
# what the preps write per chunk slot (their signatures' names): at most a [C, K] tile each ([C, C], [K, C], [K])
PREP_OUTPUTS = OUTPUTS["prep"] | OUTPUTS["prep_bwd"]


def inputs(sig: dict[str, str], B: int, T: int, H: int, K: int, TC: int, dev: str = "cuda",
           switches: dict[str, int] | None = None) -> list[Any]:
    """Random inputs in the dtypes of the unit's signature (dense: no cu_seqlens), outputs allocated; the i32
    on/off switches as a recompute runs the kernel unless ``switches`` names them."""
    g = torch.Generator(device=dev).manual_seed(0)
    n = B * triton.cdiv(T, TC)
    scale = {"q": 0.5, "k": 0.5, "a": 0.1, "b": 0.1}
    args: list[Any] = []
    for name, ty in sig.items():
        if name == "scale":
            args.append(K ** -0.5)
        elif name in ("T", "H"):
            args.append(T if name == "T" else H)
        elif name == "n_items":  # a persistent kernel's count of work items (chunk slots * H)
            args.append(n * H)
        elif ty == "i32":  # the backward prep's on/off switches, as a recompute runs it: store_pass_ops on,
            # store_fwd_ops (the forward's operands) off
            args.append((switches or {}).get(name, int(name != "store_fwd_ops")))
        elif name == "gk":
            args.append((-torch.rand(B, T, H, K, generator=g, device=dev) * 0.6).to(DTYPES[ty]))
        elif name in ("dq", "dk", "da", "db", "dg"):
            args.append(torch.empty(B, T, H, K, device=dev, dtype=DTYPES[ty]))
        elif name in PREP_OUTPUTS:  # per slot, so that a last chunk shorter than TC still has its whole tile;
            # random (a token pass that derives states reads them; e^gamma_C in (0, 1])
            x = torch.rand if name == "egc" else torch.randn
            args.append((x(n, H, TC, K, generator=g, device=dev) * (1.0 if name == "egc" else 0.1)).to(DTYPES[ty]))
        else:
            shape = (n, H, K, K) if name in ("h", "dh") else (B, T, H, K)
            args.append((torch.randn(*shape, generator=g, device=dev) * scale.get(name, 1.0)).to(DTYPES[ty]))
    return args


def as_descriptor(x: torch.Tensor, view: str, block: list[int]) -> Any:
    """A host-side TMA descriptor over ``x`` (edit key "desc": {arg: [view, block]}): view "btc" is [B, T, H*K]
    for a [B, T, H, K] tensor (rows past T read as zero and are never written), "rc" is [rows, last dim]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = x.flatten(2) if view == "btc" else x.reshape(-1, x.shape[-1])
    return TensorDescriptor.from_tensor(x, block)


def apply_edit(text: str, name: str, edit: dict[str, Any]) -> str:
    """The unit's source under one edit's text replacements (each must occur: an edit that silently matched
    nothing would time the unedited kernel under the edit's name)."""
    for old, new in edit.get("replace", []):
        if old not in text:
            raise SystemExit(f"edit {name}: text not found: {old[:80]!r}")
        text = text.replace(old, new)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("--shape", default="4x4096x32")
    ap.add_argument("--edits", type=Path, help="JSON: {name: {replace: [[old, new]], launch: {...}}}")
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="bwd")
    ap.add_argument("--switch", action="append", default=[], metavar="NAME=VALUE",
                    help="an i32 switch's value, e.g. store_fwd_ops=1 (the backward prep as a forward that keeps "
                         "the states runs it); default: as a recompute runs the kernel")
    args = ap.parse_args()
    kernel = KERNELS[args.kernel]
    _set_torch_allocator()  # global scratch for forms that build TMA descriptors on the device
    B, T, H = (int(x) for x in args.shape.split("x"))
    switches = {}
    for sw in args.switch:
        name, _, value = sw.partition("=")
        if not value.lstrip("-").isdigit():
            raise SystemExit(f"--switch {sw!r}: expected NAME=INTEGER, e.g. store_fwd_ops=1")
        switches[name] = int(value)
    text = args.source.read_text()
    edits: dict[str, dict[str, Any]] = {"shipped": {}}
    if args.edits:
        edits.update(json.loads(args.edits.read_text()))
    base = import_source(args.source, "unit_shipped")
    consts, launch0 = base.CONSTEXPRS[kernel], base.LAUNCH[kernel]
    K = consts["K"]
    unknown = set(switches) - {n for n, ty in base.SIGNATURES[kernel].items() if ty == "i32" and n not in ("T", "H")}
    if unknown:
        raise SystemExit(f"--switch: {sorted(unknown)} not an on/off switch of {kernel}")
    if "cu_seqlens" in base.SIGNATURES[kernel]:
        raise SystemExit("dense units only")
    xs_by_tc: dict[int, list[Any]] = {}
    ref: dict[str, torch.Tensor] = {}
    ref_tc = consts["BC"]
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name, e in edits.items():
        src = apply_edit(text, name, e)
        path = tmp / f"unit_{name}.py"
        path.write_text(src)
        mod = import_source(path, f"unit_{name}")
        launch = {**launch0, **e.get("launch", {})}
        kconsts = {**consts, **e.get("consts", {})}
        tc = kconsts["BC"]  # the kernel's chunk (the token pass's: h and dh hold one state per tc tokens)
        if tc not in xs_by_tc:
            xs_by_tc[tc] = inputs(base.SIGNATURES[kernel], B, T, H, K, tc, switches=switches)
        xs = xs_by_tc[tc]
        nkb = triton.cdiv(K, kconsts["BK"]) if args.kernel == "bwd" else 1  # token pass: a program per K block
        grid = (triton.cdiv(B * triton.cdiv(T, tc) * H * nkb, e.get("grid_div", 1)),)
        # a unit whose token pass is the Gluon kernel keeps its Triton form, which the edit sets edit: time that
        # (the Gluon kernel's own forms: benchmarks/edits/session21/run_tok.py)
        fn = getattr(mod, "TRITON_FORMS", {}).get(kernel, getattr(mod, kernel))
        outs = {n: x for n, x in zip(base.SIGNATURES[kernel], xs) if n in OUTPUTS[args.kernel]}
        for x in outs.values():
            x.fill_(float("nan"))

        kargs = [as_descriptor(x, *e["desc"][n]) if n in e.get("desc", {}) else x
                 for n, x in zip(base.SIGNATURES[kernel], xs)]

        def run() -> None:
            fn[grid](*kargs, **kconsts, **launch)

        try:
            run()
            torch.cuda.synchronize()
            diff = None
            if name == "shipped":
                ref = {n: x.clone() for n, x in outs.items()}
            elif tc == ref_tc:
                diff = max(float((x.float() - ref[n].float()).abs().max()) for n, x in outs.items())
            ms = triton.testing.do_bench(run, warmup=25, rep=200)
        except Exception as ex:  # noqa: BLE001 - one failing form (e.g. it does not compile) must not end the sweep
            rows.append({"edit": name, "ms": None, "error": f"{type(ex).__name__}: {str(ex)[-300:]}"})
            print(f"{args.shape} {name:>24}: FAILED {type(ex).__name__}: {str(ex)[-200:]}", flush=True)
            continue
        regs = spills = None
        try:  # Triton's JIT cache is internal: registers and spills are a bonus, not the measurement
            k = next(iter(fn.device_caches[torch.cuda.current_device()][0].values()))
            k._init_handles()
            regs, spills = k.n_regs, k.n_spills
        except Exception:  # noqa: BLE001
            pass
        rows.append({"edit": name, "ms": round(ms, 4), "launch": launch, "constexprs": kconsts, "n_regs": regs,
                     "n_spills": spills, "grid": grid[0], "max_abs_diff_vs_shipped": diff})
        print(f"{args.shape} {name:>24}: {ms:.4f} ms  regs {regs} spills {spills}  diff {diff}", flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    stem = "token" if args.kernel == "bwd" else args.kernel
    tag = "".join(f"_{n}{v}" for n, v in sorted(switches.items()))
    (out / f"{stem}_edits_{args.shape}{tag}.json").write_text(json.dumps({
        "source": str(args.source), "kernel": kernel, "shape": [B, T, H, K], "switches": switches,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

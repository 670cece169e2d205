"""Time the states pass + reverse pass (shipped, one after the other) against one kernel that walks both
(chunk_dplr_states_both_kernel, appended to the unit), on the same random inputs; outputs compared."""
import json, os, sys, tempfile
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from dplr_gen.compile import import_source
from dplr_gen import runtime as _rt
if _rt.interpreting(): _rt.interpreter_numpy_compat()

unit, shape, cfgs = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
B, T, H = (int(x) for x in shape.split("x"))
src = unit.read_text() + (Path(__file__).parent / "both_kernel.py").read_text()
tmp = Path(tempfile.mkdtemp()) / "unit_both.py"
tmp.write_text(src)
mod = import_source(tmp, "unit_both")
cf, cr = mod.CONSTEXPRS["chunk_dplr_fwd_h_kernel"], mod.CONSTEXPRS["chunk_dplr_bwd_dh_kernel"]
K, V, C = cf["K"], cf["V"], cf["BC"]
HC = mod.OPTIONS["states_every"]
R = HC // C
dev = "cpu" if os.environ.get("TRITON_INTERPRET") else "cuda"
g = torch.Generator(device=dev).manual_seed(0)
ns, nh = B * triton.cdiv(T, C), B * triton.cdiv(T, HC)
bf = torch.bfloat16
def rn(*s, sc=0.1, dt=bf):
    return (torch.randn(*s, generator=g, device=dev) * sc).to(dt)
X = {
    "kwt": rn(ns, H, K, C), "bwt": rn(ns, H, K, C), "qwt": rn(ns, H, K, C), "awt": rn(ns, H, K, C),
    "w": rn(ns, H, C, K), "y": rn(ns, H, C, K), "m": rn(ns, H, C, C), "p": rn(ns, H, C, C),
    "aqkt": rn(ns, H, C, C), "aakt": rn(ns, H, C, C),
    "egc": (0.5 + 0.5 * torch.rand(ns, H, K, generator=g, device=dev)),
    "v": rn(B, T, H, V, sc=1.0), "do": rn(B, T, H, V, sc=1.0),
    "h0": rn(B * H, K, V, sc=1.0, dt=torch.float32), "dht": rn(B * H, K, V, sc=1.0, dt=torch.float32),
    "h": torch.empty(nh, H, K, V, device=dev, dtype=bf), "dh": torch.empty(nh, H, K, V, device=dev, dtype=bf),
    "ht": torch.empty(B * H, K, V, device=dev), "dh0": torch.empty(B * H, K, V, device=dev),
    "u": torch.empty(B, T, H, V, device=dev, dtype=bf), "dr": torch.empty(B, T, H, V, device=dev, dtype=bf),
    "dv": torch.empty(B, T, H, V, device=dev, dtype=bf),
    "scale": K ** -0.5, "T": T, "H": H,
}
OUTS = ["h", "dh", "ht", "dh0", "u", "dr", "dv"]
def args(kernel):
    return [X[n] for n in mod.SIGNATURES[kernel]]
def poison():
    for n in OUTS:
        X[n].fill_(float("nan"))
kf, kr, kb = mod.chunk_dplr_fwd_h_kernel, mod.chunk_dplr_bwd_dh_kernel, mod.chunk_dplr_states_both_kernel
lf, lr = mod.LAUNCH["chunk_dplr_fwd_h_kernel"], mod.LAUNCH["chunk_dplr_bwd_dh_kernel"]
def fwd():
    kf[(B * H, triton.cdiv(V, cf["BV"]))](*args("chunk_dplr_fwd_h_kernel"), **cf, **lf)
def rev():
    kr[(B * H, triton.cdiv(V, cr["BV"]))](*args("chunk_dplr_bwd_dh_kernel"), **cr, **lr)
def seq():
    fwd(); rev()
side = torch.cuda.Stream() if dev == "cuda" else None
def overlapped():  # the driver's side-stream form (where it picks it)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd()
    rev()
    torch.cuda.current_stream().wait_stream(side)
poison(); seq()
if dev == "cuda": torch.cuda.synchronize()
bench = (lambda f: triton.testing.do_bench(f, warmup=25, rep=200)) if dev == "cuda" else (lambda f: None)
# the dh slots the reverse pass never writes (none in dense) stay NaN in both
ref = {n: X[n].clone() for n in OUTS}
rows = [{"form": "fwd_h alone", "ms": bench(fwd)},
        {"form": "bwd_dh alone", "ms": bench(rev)},
        {"form": "both, one after the other (shipped)", "ms": bench(seq)},
        {"form": "both, side streams", "ms": bench(overlapped) if dev == "cuda" else None}]
names = [n for n in ["kwt", "v", "bwt", "egc", "w", "m", "h0", "h", "ht", "u", "qwt", "awt", "y", "p", "aqkt",
                     "aakt", "do", "dht", "dh", "dh0", "dr", "dv", "scale", "T", "H"]]
for c in cfgs:
    BV, nw, st = c["BV"], c["warps"], c["stages"]
    launch = {"num_warps": nw, "num_stages": st, **({"maxnreg": c["maxnreg"]} if c.get("maxnreg") else {})}
    def both():
        kb[(B * H, triton.cdiv(V, BV))](*[X[n] for n in names], K=K, V=V, BC=C, BK=cf["BK"], BV=BV, R=R, HC=HC,
                                         **launch)
    try:
        poison(); both()
        if dev == "cuda": torch.cuda.synchronize()
        diff = {n: float((X[n].float() - ref[n].float()).abs().nan_to_num(nan=float("inf")).max()) for n in OUTS}
        ms = bench(both)
    except Exception as ex:
        rows.append({"form": f"combined {c}", "error": str(ex)[-300:]}); print(rows[-1], flush=True); continue
    regs = spills = None
    try:
        k = next(iter(kb.device_caches[torch.cuda.current_device()][0].values())); k._init_handles()
        regs, spills = k.n_regs, k.n_spills
    except Exception:
        pass
    rows.append({"form": f"combined {c}", "ms": ms, "max_abs_diff": diff, "regs": regs, "spills": spills})
for r in rows:
    print(shape, json.dumps(r), flush=True)
out = Path(os.environ.get("OUT", "out")); out.mkdir(parents=True, exist_ok=True)
(out / f"both_{unit.parent.name}_{shape}.json").write_text(json.dumps({"unit": str(unit), "shape": [B, T, H, K],
    "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
    "rows": rows}, indent=1))

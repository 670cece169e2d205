"""On the CPU: one unit's kernel compiled for sm_90 as shipped and under the edits of a time_token_edits.py JSON
file (text replacements, launch and constexpr overrides, host-side descriptors), with ptxas's registers and
spills, shared memory, MMA -> MMA conversions, TMA copies and global scratch per form.

    python benchmarks/edits/session19/cpu_edits.py generated/hopper/<unit>/sm_90.py EDITS.json [bwd] [FORM ...]
"""
import json, sys, tempfile
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
from dplr_gen.compile import import_source
from dplr_gen import triton_compat
from ptxas_report import ptxas_info
from time_token_edits import apply_edit, KERNELS

src, edits_file = Path(sys.argv[1]), Path(sys.argv[2])
kern = KERNELS[sys.argv[3] if len(sys.argv) > 3 else "bwd"]
only = sys.argv[4:] 
text = src.read_text()
edits = {"shipped": {}, **json.loads(edits_file.read_text())}
tmp = Path(tempfile.mkdtemp())
for name, e in edits.items():
    if only and name not in only: continue
    s = apply_edit(text, name, e)
    p = tmp / f"u_{name}.py"; p.write_text(s)
    m = import_source(p, f"u_{name}")
    launch = {**m.LAUNCH[kern], **e.get("launch", {})}
    consts = {**m.CONSTEXPRS[kern], **e.get("consts", {})}
    sig = dict(m.SIGNATURES[kern])
    for n, (view, blk) in e.get("desc", {}).items():
        sig[n] = f"tensordesc<{sig[n][1:]}[{','.join(map(str, blk))}]>"
    try:
        res = triton_compat.compile_kernel(getattr(m, kern), sig, consts, 90,
                                           launch.pop("num_warps"), launch.pop("num_stages"), launch)
    except Exception as ex:
        print(name, "FAILED", str(ex)[-1500:]); continue
    ptx = next(v for k, v in res.files.items() if k.endswith(".ptx"))
    info = ptxas_info(ptx.decode() if isinstance(ptx, bytes) else ptx, 90)
    conv = triton_compat.mma_conversions(res.ttgir)
    print(name, info, "shared", res.shared, "mma_conv", len(conv), "scratch", res.metadata.get("global_scratch_size"), flush=True)
    if True:
        pt = ptx.decode() if isinstance(ptx, bytes) else ptx
        mj = next(v for k, v in res.files.items() if k.endswith(".json"))
        mj = json.loads(mj)
        print("   tma copies", pt.count("cp.async.bulk.tensor"), "tensormap", pt.count("tensormap"), "scratch", mj.get("global_scratch_size"), mj.get("global_scratch_align"))

import sys, re, collections, subprocess, importlib.util
from pathlib import Path
import triton
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.compiler import GPUTarget
sys.path.insert(0, "/work/main")
from dplr_gen.compile import import_source
unit = import_source(Path("/work/main/generated/hopper/chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32/sm_90.py"), "u")
spec = importlib.util.spec_from_file_location("tg", sys.argv[1]); tg = importlib.util.module_from_spec(spec); spec.loader.exec_module(tg)
fn = getattr(tg, sys.argv[2] if len(sys.argv) > 2 else "token_pass_gluon")
sig = dict(unit.SIGNATURES["chunk_dplr_bwd_kernel"]); consts = dict(unit.CONSTEXPRS["chunk_dplr_bwd_kernel"])
launch = dict(unit.LAUNCH["chunk_dplr_bwd_kernel"])
print("shipped launch", launch, consts)
nw = int(sys.argv[3]) if len(sys.argv) > 3 else 4
names = list(fn.arg_names)
full = {n: ("constexpr" if n in consts else sig[n]) for n in names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if full[n].startswith("*")}
src = GluonASTSource(fn, full, consts, attrs)
opts = {"num_warps": nw}
if len(sys.argv) > 4: opts["maxnreg"] = int(sys.argv[4])
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
Path("/tmp/gl.ttgir").write_text(c.asm["ttgir"])
Path("/tmp/gl.cubin").write_bytes(c.asm["cubin"])
bindir = Path(triton.__file__).parent / "backends/nvidia/bin"
sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", "/tmp/gl.cubin"], capture_output=True, text=True).stdout
Path("/tmp/gl.sass").write_text(sass)
ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
ops = collections.Counter(i.split(".")[0] for i in ins)
print("shared", c.metadata.shared, "total", len(ins), ops.most_common(30))
ptx = c.asm["ptx"]
sys.path.insert(0, "/work/main/scripts")
from ptxas_report import ptxas_info
print(ptxas_info(ptx, 90))

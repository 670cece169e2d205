"""On the CPU: compile a unit's kernel for sm_90 and report ptxas's registers and spills, shared memory and the
SASS's instruction mix (barriers, shared-memory traffic), e.g. for the Gluon token pass of a generated unit.

    python cpu_compile.py generated/hopper/<unit>/sm_90.py [--kernel chunk_dplr_bwd_kernel] [--maxnreg N]
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from dplr_gen.compile import import_source  # noqa: E402
from dplr_gen.triton_compat import make_source  # noqa: E402
from ptxas_report import ptxas_info  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("unit", type=Path)
    ap.add_argument("--kernel", default="chunk_dplr_bwd_kernel")
    ap.add_argument("--maxnreg", type=int, default=0)
    ap.add_argument("--divisible", nargs="*", default=[], help="integer arguments the JIT would mark divisible by 16")
    ap.add_argument("--triton-form", action="store_true", help="the unit's Triton form of the kernel")
    args = ap.parse_args()
    unit = import_source(args.unit, "unit")
    fn = unit.TRITON_FORMS[args.kernel] if args.triton_form else getattr(unit, args.kernel)
    launch = dict(unit.LAUNCH[args.kernel])
    if args.maxnreg:
        launch["maxnreg"] = args.maxnreg
    src = make_source(fn, unit.SIGNATURES[args.kernel], unit.CONSTEXPRS[args.kernel], divisible_args=args.divisible)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch)
    cubin = Path("/tmp/cpu_compile.cubin")
    cubin.write_bytes(c.asm["cubin"])
    Path("/tmp/cpu_compile.ttgir").write_text(c.asm["ttgir"])
    sass = subprocess.run([str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"), "-sass", str(cubin)],
                          capture_output=True, text=True).stdout
    Path("/tmp/cpu_compile.sass").write_text(sass)
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    ops = collections.Counter(i.split(".")[0] for i in ins)
    print("launch", launch, "shared", c.metadata.shared, "instructions", len(ins))
    print({k: ops[k] for k in ("BAR", "LDS", "STS", "LDSM", "LDG", "STG", "HMMA", "LDL", "STL", "SHFL")})
    print(ptxas_info(c.asm["ptx"], 90))


if __name__ == "__main__":
    main()

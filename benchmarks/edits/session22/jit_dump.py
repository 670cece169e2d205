"""On the GPU: JIT-compile one kernel of each given unit at a shape (as run_units.py launches it) and report the
compiled kernel's registers, spills and SASS instruction mix, with the SASS saved under $OUT."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from dplr_gen.compile import import_source  # noqa: E402
from time_token_edits import inputs  # noqa: E402

KERNEL = "chunk_dplr_bwd_kernel"
out = Path(os.environ.get("OUT", "out"))
B, T, H = (int(x) for x in sys.argv[1].split("x"))
for i, spec in enumerate(sys.argv[2:]):
    name, _, path = spec.partition("=")
    unit = import_source(Path(path), f"u{i}")
    fn = getattr(unit, KERNEL)
    consts, launch = unit.CONSTEXPRS[KERNEL], dict(unit.LAUNCH[KERNEL])
    xs = inputs(unit.SIGNATURES[KERNEL], B, T, H, consts["K"], consts["BC"])
    grid = (B * triton.cdiv(T, consts["BC"]) * H * triton.cdiv(consts["K"], consts["BK"]),)
    k = fn[grid](*xs, **consts, **launch)
    torch.cuda.synchronize()
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(k.asm["cubin"])
    (out / f"{name}.ttgir").write_text(k.asm["ttgir"])
    sass = subprocess.run([str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"), "-sass", str(cubin)],
                          capture_output=True, text=True).stdout
    (out / f"{name}.sass").write_text(sass)
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    ops = collections.Counter(x.split(".")[0] for x in ins)
    print(name, "regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared, "instructions", len(ins),
          {o: ops[o] for o in ("BAR", "LDG", "STG", "HMMA", "LDL", "STL", "SHFL")}, flush=True)

"""GPU smoke test of the build -> cache -> AOT load path (run on the GPU machine).

Builds a fused-recurrent-only spec for this GPU into a temporary folder, then in a FRESH process loads it with
DPLR_GEN_NO_JIT=1 (so any run-time compile is an error), runs bf16/fp32 forward against the float64 reference,
and times the cold start. Writes JSON to $OUT/gpu_smoke.json (or ./gpu_smoke.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPEC = """
name: smoke
targets: [{target}]
variants:
  - ops: [fused_recurrent]
    dtypes: [bf16, fp32]
    head_dims: [64, [60, 100]]
    varlen: [false, true]
"""

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
from dplr_gen.runtime import package_at
from dplr_gen import ops
from dplr_gen.testing import rwkv7_inputs, rel_err
from dplr_gen.reference import naive_dplr_delta_rule
pkg = package_at(sys.argv[1])
res = {"import_s": time.perf_counter() - t0, "cases": []}
for dtype in (torch.bfloat16, torch.float32):
    for (K, V) in ((64, 64), (60, 100)):
        for varlen in (False, True):
            x = rwkv7_inputs(2 if not varlen else 1, 300, 4, K, V, dtype=dtype, device="cuda")
            cu = torch.tensor([0, 1, 137, 300], device="cuda") if varlen else None
            if varlen:
                x["initial_state"] = torch.randn(3, 4, K, V, device="cuda") * 0.5
            t1 = time.perf_counter()
            o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, cu_seqlens=cu, package=pkg)
            torch.cuda.synchronize()
            first = time.perf_counter() - t1
            ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True, cu_seqlens=cu)
            res["cases"].append({"dtype": str(dtype), "K": K, "V": V, "varlen": varlen, "first_call_s": first,
                                 "err_o": rel_err(o, ro), "err_ht": rel_err(ht, rht)})
ks = [pkg.kernel_set(n, pkg.targets[0]) for n in pkg.variant_names]
res["aot_loaded"] = all(bool(k.aot) for k in ks)
res["total_s"] = time.perf_counter() - t0
print("RESULT " + json.dumps(res))
"""


def main() -> int:
    import torch

    out_dir = Path(os.environ.get("OUT", "."))
    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major * 10 + minor}"
    work = Path(tempfile.mkdtemp(prefix="dplr-smoke-"))
    spec = work / "smoke.yaml"
    spec.write_text(SPEC.format(target=target))
    env = dict(os.environ, DPLR_GEN_CACHE_DIR=str(work / "cache"))
    t0 = time.perf_counter()
    build = subprocess.run([sys.executable, "-m", "dplr_gen.cli", "build", str(spec), "-j", "8"],
                           capture_output=True, text=True, env=env)
    build_s = time.perf_counter() - t0
    print(build.stdout[-2000:], build.stderr[-3000:])
    # the build writes into generated/ by default: point it at our temp folder instead
    result = {"gpu": torch.cuda.get_device_name(), "target": target, "torch": torch.__version__,
              "build_rc": build.returncode, "build_s": build_s}
    pkg_dir = Path(__file__).resolve().parent.parent / "generated" / "smoke"
    child = subprocess.run([sys.executable, "-c", CHILD, str(pkg_dir)], capture_output=True, text=True,
                           env=dict(env, DPLR_GEN_NO_JIT="1"))
    print(child.stderr[-4000:])
    line = next((l for l in child.stdout.splitlines() if l.startswith("RESULT ")), None)
    result["child"] = json.loads(line[7:]) if line else {"error": child.stderr[-4000:]}
    (out_dir / "gpu_smoke.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

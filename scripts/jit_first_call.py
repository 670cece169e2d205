"""Time to the first result of a variant generated on demand, and that the next process pays none of it (GPU).

    python scripts/jit_first_call.py OUT.json [--cases chunk:bf16:96:96:-0.61,chunk:bf16:100:60:none] [--shape 2x512x4]
                                              [--jobs 0,1]

For each case (op:dtype:K:V:lower_bound, none = any gate) two fresh processes run one after the other with the
same empty DPLR_GEN_CACHE_DIR (and each its own empty TRITON_CACHE_DIR): the first calls ``dplr_gen.<op>``
(the dispatcher: the built spec covering this GPU, which does not build the variant), so the variant is
rendered, its kernels compiled in parallel subprocesses into the cache, loaded and run forward+backward; the
second does the same and must find everything in the cache. Each child reports the wall time of its first
forward+backward (synchronised), what dplr_gen.runtime.ondemand did (kernels compiled, compile subprocesses, cache
hits), the log line it emitted, and the relative errors of the output, final state and every gradient against
the float64 reference. Writes JSON to OUT.json; exit 1 if a second process compiled anything or an error is
over its bound (bf16/fp16: 1e-2, fp32: 1e-4). ``--jobs``: the compile processes of the first child
(DPLR_GEN_JIT_JOBS; 0: one per CPU, the default), each case run once per value, to measure what compiling the
kernels side by side buys.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, logging, sys, time
t0 = time.perf_counter()
import torch
import dplr_gen
from dplr_gen.runtime import ondemand
from dplr_gen.reference import naive_dplr_delta_rule
from dplr_gen.testing import rel_err, rwkv7_inputs
lines = []
class Keep(logging.Handler):
    def emit(self, r): lines.append(f"{r.levelname}: {r.getMessage()}")
logging.getLogger("dplr_gen").addHandler(Keep()); logging.getLogger("dplr_gen").setLevel(logging.INFO)
op, dtype, K, V, bound = sys.argv[1].split(":")
B, T, H = (int(x) for x in sys.argv[2].split("x"))
dev = sys.argv[3]  # cuda; cpu runs the interpreter (a smoke test of this script: nothing compiles there)
K, V, bound = int(K), int(V), None if bound == "none" else float(bound)
dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
torch.zeros(1, device=dev); sync()
x = {n: t.requires_grad_(True) for n, t in rwkv7_inputs(B, T, H, K, V, dtype=dt, device=dev, seed=0).items()}
do = torch.randn(B, T, H, V, device=dev, dtype=dt); dht = torch.randn(B, H, K, V, device=dev)
fn = getattr(dplr_gen, f"{op}_dplr_delta_rule")
kw = {"lower_bound": bound} if bound is not None else {}
t_ready = time.perf_counter()
o, ht = fn(**x, output_final_state=True, **kw)
torch.autograd.backward((o, ht), (do, dht)); sync()
t_first = time.perf_counter()
o2, ht2 = fn(**{n: t.detach() for n, t in x.items()}, output_final_state=True, **kw); sync()
t_second_call = time.perf_counter() - t_first
x64 = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
ro, rht = naive_dplr_delta_rule(**x64, output_final_state=True)
torch.autograd.backward((ro, rht), (do.double(), dht.double()))
errors = {"o": rel_err(o, ro), "ht": rel_err(ht, rht), **{n: rel_err(t.grad, x64[n].grad) for n, t in x.items()}}
print("RESULT " + json.dumps({
    "first_fwd_bwd_s": t_first - t_ready, "process_to_first_result_s": t_first - t0, "next_call_fwd_s": t_second_call,
    "ondemand": dict(ondemand.STATS), "log": lines, "errors": errors,
    "package": dplr_gen.runtime.dispatch.default_package().package_for(torch.device(dev)).name,
}))
"""


def run_child(case: str, shape: str, cache_dir: str, device: str, jobs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as tcache:
        env = {**os.environ, "DPLR_GEN_CACHE_DIR": cache_dir, "TRITON_CACHE_DIR": tcache,
               "DPLR_GEN_JIT_JOBS": str(jobs)}
        for var in ("DPLR_GEN_NO_JIT", "TRITON_INTERPRET"):
            env.pop(var, None)
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", CHILD, case, shape, device], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=900)
        wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"ok": False, "returncode": p.returncode, "stderr_tail": p.stderr[-4000:], "wall_s": wall}
    return {"ok": True, "wall_s": wall, **json.loads(lines[-1][len("RESULT "):])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default="chunk:bf16:96:96:-0.61,chunk:bf16:100:60:none,chunk:fp16:60:60:none")
    ap.add_argument("--shape", default="2x512x4", help="BxTxH")
    ap.add_argument("--jobs", default="0,1", help="compile processes of the first child, per run (0: one per CPU)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (interpreter)")
    args = ap.parse_args()
    results = []
    failed = False
    for case in args.cases.split(","):
        for jobs in (int(j) for j in args.jobs.split(",")):
            with tempfile.TemporaryDirectory(prefix="dplr-gen-jit-") as cache_dir:
                first = run_child(case, args.shape, cache_dir, args.device, jobs)
                second = run_child(case, args.shape, cache_dir, args.device, jobs)
            bound = 1e-4 if ":fp32:" in case else 1e-2
            checks = {
                "first_ran": first.get("ok", False) and first["ondemand"].get("compiled_kernels", 0) > 0,
                "second_compiled_nothing": second.get("ok", False) and not second["ondemand"].get("compile_jobs")
                and not second["ondemand"].get("compiled_kernels"),
                "errors_within_bound": all(r.get("ok") and max(r["errors"].values()) <= bound for r in (first, second)),
            }
            failed |= not all(checks.values())
            results.append({"case": case, "shape": args.shape, "jit_jobs": jobs, "first_process": first,
                            "second_process": second, "checks": checks, "error_bound": bound})
            print(json.dumps({"case": case, "jit_jobs": jobs, **checks,
                              "first_fwd_bwd_s": first.get("first_fwd_bwd_s"),
                              "second_fwd_bwd_s": second.get("first_fwd_bwd_s")}), flush=True)
    import torch
    import triton

    out = {
        "what": "first forward+backward of on-demand variants in fresh processes; second process with the same cache",
        "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "results": results, "all_pass": not failed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

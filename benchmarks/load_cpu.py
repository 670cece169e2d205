"""dplr-gen's share of a cold start, measured without a GPU: fresh processes that, after `import torch`, import
the ops, open a built package, choose a variant and load its ahead-of-time kernels (no launch).

    python benchmarks/load_cpu.py [--package generated/hopper] [--runs 9] [--checkout DIR] [--out DIR]

The package must have been built on this machine (`dplr-gen build specs/hopper.yaml`: its manifest and cache
entries). Reports the median over --runs processes of (import + select) and (load), and which of pydantic, yaml,
jinja2 the process imported; also the per-call cost of the dispatcher behind `dplr_gen.<op>`. Writes
DIR/load_cpu_<date>.json. --checkout runs another checkout's dplr_gen on the same package (an earlier commit whose
generated/ is the same), for a before/after pair. On the GPU machine scripts/cold_start.py measures the whole
first training step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import common as C  # noqa: E402

CHILD = """
import json, sys, time
import torch
t0 = time.perf_counter()
from dplr_gen.runtime import ops
from dplr_gen.runtime.loader import package_at
pkg = package_at(sys.argv[1])
name = ops._select(str(pkg.dir), "chunk", torch.bfloat16, 64, 64, False, None, -0.61, torch.bfloat16)  # as the op picks
t1 = time.perf_counter()
ks = pkg._load(name, "sm_90")
t2 = time.perf_counter()
# "records": launched from the build's launch records, the rendered source not imported (docs/design.md, cold start)
print(json.dumps({"variant": name, "aot": bool(ks.aot), "from": "source" if hasattr(ks.module, "__file__") else "records",
                  "import_select_s": t1 - t0, "load_s": t2 - t1,
                  "heavy_modules": sorted(m for m in ("pydantic", "yaml", "jinja2") if m in sys.modules)}))
"""


DISPATCHER_CHILD = """
import timeit, torch
from dplr_gen.runtime import dispatch
d = dispatch.default_package()
dev = torch.device("cpu")
d.package_for(dev)
print(timeit.timeit(lambda: d.package_for(dev), number=20000) / 20000 * 1e6)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--checkout", default=str(REPO), help="the checkout whose dplr_gen runs (default: this one)")
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    args = ap.parse_args()
    if not (Path(args.package) / "manifest.json").is_file():
        ap.error(f"--package {args.package!r} has no manifest.json: build it on this machine first")
    env = dict(os.environ, TRITON_INTERPRET="0", DPLR_GEN_NO_JIT="1", PYTHONPATH=args.checkout)
    rows = []
    for _ in range(args.runs):
        proc = subprocess.run([sys.executable, "-c", CHILD, args.package], env=env, capture_output=True, text=True,
                              cwd=args.checkout)  # -c puts the working directory first on sys.path
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    disp = subprocess.run([sys.executable, "-c", DISPATCHER_CHILD], capture_output=True, text=True, check=True,
                          env=dict(env, TRITON_INTERPRET="1"), cwd=args.checkout)  # the dispatcher, CPU tensors
    result = {
        "machine": {**C.machine_info("cpu"), "platform": platform.platform(), "cpus": os.cpu_count()},
        "package": args.package, "checkout": args.checkout,
        "checkout_commit": C._cmd("git", "-C", args.checkout, "rev-parse", "--short", "HEAD"), "runs": rows,
        "median_import_select_s": statistics.median(r["import_select_s"] for r in rows),
        "median_load_s": statistics.median(r["load_s"] for r in rows),
        "median_total_s": statistics.median(r["import_select_s"] + r["load_s"] for r in rows),
        "dispatcher_package_for_us": float(disp.stdout.strip().splitlines()[-1]),
    }
    out = Path(args.out) / f"load_cpu_{C.stamp()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    C.write_json(out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

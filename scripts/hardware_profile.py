"""Where each kernel of a forward+backward stands against the hardware: Nsight Compute's counters per kernel.

    python scripts/hardware_profile.py [--cases dense4x4096,dense8x4096x64,dense8x2048x16x128] [--bounds -0.61]

For each case (scripts/kernel_profile.py's shapes and call, ``case_call``: bf16 RWKV-7, initial and final states,
gradients of every input) a child process loads the package, runs the call three times, then one more call between
cudaProfilerStart and cudaProfilerStop under `ncu --profile-from-start off --clock-control none` (the clocks left
as the machine runs them). Per kernel it records the time, the DRAM bytes read and written and the rate they
make, DRAM and SM throughput as a share of their peaks, the tensor pipes' active cycles (mma.sync and, on Hopper,
wgmma) as a share of theirs, achieved occupancy and registers per thread. Metrics the installed ncu does not know
are left out (listed under "metrics_missing"). Writes $OUT/hardware_profile.json (./out/ without $OUT).
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# short name -> ncu metric (the base name is what --query-metrics lists)
METRICS: dict[str, str] = {
    "time_ns": "gpu__time_duration.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "dram_pct_of_peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct_of_peak": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_bytes": "lts__t_bytes.sum",
    "tensor_mma_pct_active": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_wgmma_pct_active": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    hits = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/bin/ncu"))
    return hits[-1] if hits else None


def known_metrics(ncu: str) -> set[str] | None:
    """The base names ncu lists for the GPU here, or None if it cannot list them."""
    try:
        out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip() and "__" in line.split()[0]}
    return names or None


def parse_raw_csv(text: str, wanted: dict[str, str]) -> list[dict[str, Any]]:
    """ncu's `--csv --page raw` output: a header row of metric names, a row of units, a row per kernel."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return []
    header, body = rows[0], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    kernels = []
    for row in body:
        rec: dict[str, Any] = {"kernel": row[col["Kernel Name"]] if "Kernel Name" in col else row[0]}
        for short, metric in wanted.items():
            if metric in col:
                raw = row[col[metric]].replace(",", "")
                try:
                    rec[short] = float(raw)
                except ValueError:
                    rec[short] = raw
        if isinstance(rec.get("time_ns"), float) and rec["time_ns"] > 0:
            moved = sum(rec.get(k, 0.0) for k in ("dram_read_bytes", "dram_write_bytes")
                        if isinstance(rec.get(k), float))
            rec["dram_gb_per_s"] = round(moved / rec["time_ns"], 1)
        kernels.append(rec)
    return kernels


def child(case: str, lower_bound: float | None, package: str) -> None:
    import torch

    from dplr_gen.runtime import ops
    from dplr_gen.runtime.loader import package_at
    from kernel_profile import CASES, case_call

    pkg = package_at(package)

    def op(*a: Any, **k: Any) -> Any:
        return ops.chunk_rwkv7(*a, package=pkg, **k)

    call = case_call(op, CASES[case], lower_bound, "cuda", dry=False)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main(argv: list[str] | None = None) -> int:
    from kernel_profile import CASES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="dense4x4096,dense8x4096x64,dense8x2048x16x128")
    ap.add_argument("--bounds", default="-0.61", help="comma list of lower_bound values; none: the call without it")
    ap.add_argument("--package", default="generated/hopper")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per case")
    args = ap.parse_args(argv)
    bounds = [None if b.strip().lower() == "none" else float(b) for b in args.bounds.split(",")]
    if args.child:
        child(args.child, bounds[0], args.package)
        return 0
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; valid: {sorted(CASES)}")

    from benchmarks import common as C

    out_dir = Path(os.environ.get("OUT") or "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"script": "scripts/hardware_profile.py", "machine": C.machine_info("cuda"),
                              "package": args.package, "cases": {}}
    ncu = find_ncu()
    if ncu is None:
        result["error"] = "ncu not found"
        (out_dir / "hardware_profile.json").write_text(json.dumps(result, indent=1))
        print(result["error"])
        return 1
    known = known_metrics(ncu)
    # launch__* attributes are not counters: --query-metrics does not list them
    wanted = {s: m for s, m in METRICS.items()
              if known is None or m.startswith("launch__") or m.split(".")[0] in known}
    result["ncu"] = ncu
    result["metrics"] = wanted
    result["metrics_missing"] = sorted(set(METRICS) - set(wanted))
    for case in args.cases.split(","):
        for lb in bounds:
            key = f"{case}, lower_bound={lb}"
            cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw",
                   "--print-units", "base", "--metrics", ",".join(wanted.values()),
                   sys.executable, str(Path(__file__).resolve()), "--child", case,
                   "--bounds", "none" if lb is None else str(lb), "--package", args.package]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            except subprocess.TimeoutExpired:
                result["cases"][key] = {"error": f"timed out after {args.timeout} s"}
                continue
            kernels = parse_raw_csv(run.stdout, wanted)
            rec: dict[str, Any] = {"shape": list(CASES[case][:4]), "kernels": kernels}
            if run.returncode != 0 or not kernels:
                rec["error"] = f"rc={run.returncode}: {(run.stderr or run.stdout)[-1500:]}"
            result["cases"][key] = rec
            print(key, flush=True)
            for k in kernels:
                print(f"  {k.get('time_ns', 0) / 1e3:8.1f} us  dram {k.get('dram_gb_per_s', 0):7.1f} GB/s "
                      f"({k.get('dram_pct_of_peak', 0):5.1f}%)  sm {k.get('sm_pct_of_peak', 0):5.1f}%  "
                      f"mma {k.get('tensor_mma_pct_active', 0)}  wgmma {k.get('tensor_wgmma_pct_active', 0)}  "
                      f"occ {k.get('occupancy_pct', 0)}  {str(k['kernel'])[:60]}", flush=True)
            (out_dir / "hardware_profile.json").write_text(json.dumps(C.jsonable(result), indent=1))
    (out_dir / "hardware_profile.json").write_text(json.dumps(C.jsonable(result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

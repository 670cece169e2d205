"""Registers and spills of a built package's kernels, read on the CPU (no GPU): ptxas -v on the PTX the build kept.

    python scripts/ptxas_report.py generated/hopper [--match bf16_k128] [--json OUT.json]

For every kernel of every unit in the package's manifest.json (written by `dplr-gen build` on this machine),
the PTX in its cache entry is assembled again with the ptxas that Triton bundles, with Triton's own flags
(-lineinfo -v --gpu-name=sm_XXa), and the report lists registers per thread, spill stores/loads (bytes per
thread) and shared memory. Registers bound occupancy (65536 per SM: 255 at 4 warps leaves room for two blocks)
and spills become local-memory traffic, so this is the CPU's view of what the GPU's profiler would say; it is
not a timing.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INFO = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def ptxas_info(ptx: str, arch: int) -> dict[str, int]:
    """ptxas -v on one PTX text, as Triton's compiler calls it (its ptxas and target name): registers, spill
    stores/loads and stack frame in bytes per thread."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", f"--gpu-name={sm_arch_from_capability(arch)}",
                               str(src), "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {proc.stderr.strip()[-2000:]}")
    out: dict[str, int] = {}
    for key, rx in INFO.items():
        m = rx.search(proc.stderr)
        out[key] = int(m.group(1)) if m else 0
    return out


def report(package: Path, match: str | None = None) -> list[dict[str, Any]]:
    from dplr_gen.toolchain import cache

    manifest_file = package / "manifest.json"
    if not manifest_file.is_file():
        raise SystemExit(f"{package}: no manifest.json; run `dplr-gen build specs/{package.name}.yaml` on this machine first")
    manifest = json.loads(manifest_file.read_text())
    root = Path(manifest.get("cache_root") or cache.cache_root())
    rows = []
    for unit, rec in sorted(manifest["units"].items()):
        if match and match not in unit:
            continue
        for k in rec["kernels"]:
            entry = cache.entry_dir(k["key"], k["triton_version"], root)
            ptx_file = entry / f"{k['kernel']}.ptx"
            if not ptx_file.is_file():
                raise SystemExit(f"{unit}: {ptx_file} is missing (cache moved or cleaned?); rebuild the package")
            arch = int(k["target"].removeprefix("sm_"))
            rows.append({"unit": unit, "kernel": k["kernel"], "num_warps": k["num_warps"],
                         "num_stages": k["num_stages"], "shared": k["shared"],
                         **ptxas_info(ptx_file.read_text(), arch)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", help="a built generated/<spec> folder")
    ap.add_argument("--match", help="only units whose name contains this")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = report(Path(args.package), args.match)
    if not rows:
        raise SystemExit(f"no unit of {args.package} matches {args.match!r}")
    for r in rows:
        print(f"{r['unit']:60s} {r['kernel']:34s} warps {r['num_warps']} stages {r['num_stages']} "
              f"regs {r['registers']:3d} spill {r['spill_stores']:4d}/{r['spill_loads']:4d} B smem {r['shared']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"package": str(args.package), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

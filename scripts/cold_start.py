"""Where a fresh process spends its time before the first chunk fwd+bwd of a prebuilt variant (GPU machine).

    python scripts/cold_start.py [--package generated/hopper] [--shape 4x4096x32x64 | varlen]

Runs the same child in fresh processes with DPLR_GEN_NO_JIT=1. The child times each phase (import torch, CUDA
init, import dplr_gen, package load, inputs, first forward, first backward) and the C launcher builds Triton
does on the way (count and seconds); ``cold_start_s`` is the sum without building the inputs.
Python's bytecode: the GPU machine's site-packages hold no .pyc files (read-only), so every process there
compiles torch's sources again, unlike any installed machine. The runs therefore use a PYTHONPYCACHEPREFIX
filled once by a warm-up child (not recorded), except ``cold_no_bytecode``, which shows the machine as it is.
Runs: ``cold`` (empty TRITON_CACHE_DIR, the launch stubs dplr-gen keeps in its cache found there; backward
as a training loop calls it, ``loss.backward()``), ``cold_stubs_not_kept`` (the same with
DPLR_GEN_KEEP_STUBS=0: every stub compiled, as before dplr-gen kept them),
``cold_grad_tensors`` (the same, backward as ``torch.autograd.backward(outputs, grad_tensors)``: torch then
imports sympy for its shape check), ``warm_triton_cache`` (Triton's launcher stubs cached), ``cold_no_bytecode``
and ``cold_importtime`` (``python -X importtime``). ``--shape varlen``: the bench's varlen case (16 sequences,
32768 tokens, H=32, D=64; cu_seqlens and cu_seqlens_cpu given, zero initial state). Writes $OUT/cold_start.json.
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
import json, sys, time
t = {"start": time.perf_counter()}
import torch
t["import_torch"] = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t["cuda_init"] = time.perf_counter()
builds = []  # C compiler runs only (a module found in Triton's cache is not one)
class _CountBuilds:  # wraps Triton's C builds if Triton gets imported (a direct launch never imports it)
    def find_spec(self, name, path, target=None):
        if name != "triton.runtime.build":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(m):
            run(m)
            orig = m._build
            def timed(*a, **k):
                s = time.perf_counter(); r = orig(*a, **k); builds.append(time.perf_counter() - s); return r
            m._build = timed
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _CountBuilds())
import dplr_gen
from dplr_gen.runtime import ops
from dplr_gen.runtime.loader import package_at
t["import_dplr_gen"] = time.perf_counter()
B, T, H, D = (int(x) for x in sys.argv[2].split("x"))
lens = [int(n) for n in sys.argv[4].split(",")] if len(sys.argv) > 4 else None  # varlen: sequence lengths
pkg = package_at(sys.argv[1])
name = ops._select(str(pkg.dir), "chunk", torch.bfloat16, D, D, lens is not None, None, -0.61,
                   torch.bfloat16)  # as the op picks
ks = pkg.kernel_set(name, pkg.target_for(torch.device("cuda")))
t["load"] = time.perf_counter()
from dplr_gen.testing import rwkv7_inputs
x = {n: v.requires_grad_(True) for n, v in rwkv7_inputs(B, T, H, D, dtype=torch.bfloat16, device="cuda", seed=0,
                                                        initial_state=lens is None).items() if v is not None}
kw = {}
if lens is not None:
    cu_cpu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    kw = {"cu_seqlens": cu_cpu.cuda(), "cu_seqlens_cpu": cu_cpu}
torch.cuda.synchronize()
t["inputs"] = time.perf_counter()
n_before = len(builds)
o, ht = ops.chunk_dplr_delta_rule(**x, output_final_state=True, lower_bound=-0.61, package=pkg, **kw)
torch.cuda.synchronize()
t["first_fwd"] = time.perf_counter()
fwd_builds = builds[n_before:]
do, dht = torch.randn_like(o), torch.randn_like(ht)
if sys.argv[3] == "loss":
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
else:
    torch.autograd.backward((o, ht), (do, dht))
torch.cuda.synchronize()
t["first_bwd"] = time.perf_counter()
keys = list(t)
phases = {k: t[k] - t[p] for p, k in zip(keys, keys[1:])}
print("RESULT " + json.dumps({"phases_s": phases, "total_s": t["first_bwd"] - t["start"],
                               "cold_start_s": t["first_bwd"] - t["start"] - phases["inputs"],
                               "dplr_gen_s": sum(phases[p] for p in ("import_dplr_gen", "load", "first_fwd", "first_bwd")),
                               "backward_form": sys.argv[3], "sympy_imported": "sympy" in sys.modules,
                               "launcher_builds": len(builds), "launcher_build_s": sum(builds),
                               "launcher_builds_in_fwd": len(fwd_builds), "triton_imported": "triton" in sys.modules}))
"""


def run_child(package: str, shape: str, cache_dir: str, pycache: str | None, backward: str = "loss",
              importtime: bool = False, keep_stubs: bool = True) -> dict:
    if shape == "varlen":  # the bench's varlen case: benchmarks.bench.VARLEN
        sys.path.insert(0, str(REPO))
        from benchmarks.common import mixed_lengths

        lens = mixed_lengths(16, 32768, seed=0)
        return _run_child(package, "1x32768x32x64", cache_dir, pycache, backward, importtime, keep_stubs,
                          ",".join(str(n) for n in lens))
    return _run_child(package, shape, cache_dir, pycache, backward, importtime, keep_stubs)


def _run_child(package: str, shape: str, cache_dir: str, pycache: str | None, backward: str, importtime: bool,
               keep_stubs: bool, lengths: str | None = None) -> dict:
    """One fresh child; ``pycache``: PYTHONPYCACHEPREFIX (None: no bytecode written or read from a prefix);
    ``lengths``: varlen sequence lengths, comma-separated."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, DPLR_GEN_NO_JIT="1",
               DPLR_GEN_KEEP_STUBS="1" if keep_stubs else "0",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONPYCACHEPREFIX", None)
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = pycache
    cmd = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-c", CHILD, package, shape, backward]
    cmd += [lengths] if lengths else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=300)
    wall = time.perf_counter() - t0
    out: dict = {"wall_s": wall, "rc": proc.returncode}
    for ln in proc.stdout.splitlines():
        if ln.startswith("RESULT "):
            out.update(json.loads(ln[7:]))
    if proc.returncode:
        out["stderr"] = proc.stderr[-3000:]
    if importtime:  # "import time: self [us] | cumulative | imported package"
        rows = []
        for ln in proc.stderr.splitlines():
            if ln.startswith("import time:") and "|" in ln and "cumulative" not in ln:
                _, cum, name = (p.strip() for p in ln[len("import time:"):].split("|"))
                if not name.startswith(" ") and "." not in name.strip():
                    rows.append((int(cum) / 1e6, name.strip()))
        out["top_level_imports_s"] = dict(sorted(((n, round(s, 3)) for s, n in rows), key=lambda r: -r[1])[:15])
    return out


def kept_stubs(package: str) -> int:
    """How many C modules of Triton's driver dplr-gen's cache holds for the package's Triton release."""
    sys.path.insert(0, str(REPO))
    from dplr_gen.toolchain.launch_stubs import kept_driver_modules

    manifest = json.loads((Path(package) / "manifest.json").read_text())
    return kept_driver_modules(Path(manifest["cache_root"]), manifest["triton_version"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=str(REPO / "generated" / "hopper"))
    ap.add_argument("--shape", default="4x4096x32x64")
    args = ap.parse_args()
    fresh = lambda: tempfile.mkdtemp(prefix="triton-cold-")  # noqa: E731
    pyc = tempfile.mkdtemp(prefix="pycache-")
    warmup = run_child(args.package, args.shape, fresh(), pyc)  # fills the bytecode prefix; not recorded
    cache = fresh()
    res = {
        "shape": args.shape,
        "bytecode_warmup_rc": warmup["rc"],
        "kept_stubs": kept_stubs(args.package),
        "cold": run_child(args.package, args.shape, cache, pyc),
        "cold_stubs_not_kept": run_child(args.package, args.shape, fresh(), pyc, keep_stubs=False),
        "cold_grad_tensors": run_child(args.package, args.shape, fresh(), pyc, backward="tensors"),
        "warm_triton_cache": run_child(args.package, args.shape, cache, pyc),
        "cold_no_bytecode": run_child(args.package, args.shape, fresh(), None),
        "cold_importtime": run_child(args.package, args.shape, fresh(), pyc, importtime=True),
    }
    print(json.dumps(res, indent=1))
    out = Path(os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cold_start.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe kernels and a self check: small kernels compiled per arch (each in a child process, so an abort is
reported) to see what the installed or another Triton can compile."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

from packaging.version import Version

from .interpreter_repair import without_interpreter
from .triton_compile import compile_kernel
from .triton_versions import can_target
from .ttgir import mma_conversions

# Written to a real file: @triton.jit needs inspect.getsource. Byte-identical every time (cache key).
PROBE_SOURCE = '''\
import triton
import triton.language as tl


@triton.jit
def probe_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def probe_dot(a_ptr, b_ptr, c_ptr, BT: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, BT)
    c = tl.arange(0, D)
    a = tl.load(a_ptr + r[:, None] * D + c[None, :])
    b = tl.load(b_ptr + c[:, None] * BT + r[None, :])
    tl.store(c_ptr + r[:, None] * BT + r[None, :], tl.dot(a, b).to(c_ptr.dtype.element_ty))


@triton.jit
def probe_chain(q_ptr, k_ptr, v_ptr, w_ptr, o_ptr, stride, BT: tl.constexpr, D: tl.constexpr):
    # chunk-style: three chained dots, one result combined with another dot's result
    base = tl.program_id(0) * BT * stride
    r = tl.arange(0, BT)
    c = tl.arange(0, D)
    offs = base + r[:, None] * stride + c[None, :]
    q = tl.load(q_ptr + offs)
    k = tl.load(k_ptr + offs)
    v = tl.load(v_ptr + offs)
    w = tl.load(w_ptr + offs)
    a = tl.dot(q, tl.trans(k))
    a = tl.where(r[:, None] >= r[None, :], a, 0.0)
    u = tl.dot(w, v)
    b = tl.dot(a.to(v.dtype), v, u)
    o = tl.dot(b.to(v.dtype), tl.trans(w)) + a
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty))
'''

# kernel name -> (signature, constexprs)
PROBES: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "probe_add": ({"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 1024}),
    "probe_dot": ({"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32"}, {"BT": 64, "D": 64}),
    "probe_chain": ({"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16",
                     "stride": "i32"}, {"BT": 64, "D": 64}),
}


@functools.lru_cache(maxsize=1)
def probe_module() -> Any:
    """Import the probe kernels (written once to a temp file named by the source's content)."""
    import hashlib

    digest = hashlib.sha256(PROBE_SOURCE.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"dplr_gen_probe_{digest}.py"
    if not path.is_file() or path.read_text() != PROBE_SOURCE:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(PROBE_SOURCE)
        os.replace(tmp, path)  # atomic: parallel processes never see half a file
    spec = importlib.util.spec_from_file_location(f"dplr_gen_probe_{digest}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    with without_interpreter():  # probes are for compiling, even inside an interpreter test session
        spec.loader.exec_module(mod)
    return mod


def probe(kernel: str, arch: int, num_warps: int = 4, num_stages: int = 2) -> dict[str, Any]:
    """Compile one probe kernel in this process; returns a json-able summary (raises on failure)."""
    sig, consts = PROBES[kernel]
    res = compile_kernel(getattr(probe_module(), kernel), sig, consts, arch, num_warps, num_stages)
    return {
        "kernel": kernel, "arch": arch, "num_warps": num_warps, "num_stages": num_stages, "ok": True,
        "triton_version": res.metadata["triton_version"], "shared": res.shared,
        "seconds": round(res.seconds, 3), "files": sorted(res.files),
        "mma_conversions": len(mma_conversions(res.ttgir)),
        "mma_dot_operand_conversions": len(mma_conversions(res.ttgir, include_dot_operands=True)),
    }


def probe_subprocess(kernel: str, arch: int, num_warps: int = 4, num_stages: int = 2,
                     python: str | None = None, timeout: float = 600) -> dict[str, Any]:
    """``probe`` in a child process, so a compiler abort (SIGABRT) is reported instead of killing us.

    ``python``: another interpreter (e.g. a venv with a different Triton) to run it with.
    """
    import subprocess

    ok, why = can_target(arch, _child_version(python) if python else None)
    if not ok:
        return {"kernel": kernel, "arch": arch, "num_warps": num_warps, "ok": False, "skipped": True, "error": why}
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [python or sys.executable, "-m", "dplr_gen.toolchain.probes", kernel, str(arch), str(num_warps), str(num_stages)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode == 0 and p.stdout.strip():
        return json.loads(p.stdout.strip().splitlines()[-1])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"kernel": kernel, "arch": arch, "num_warps": num_warps, "ok": False, "returncode": p.returncode,
            "error": " | ".join(tail)}


def _child_version(python: str) -> Version:
    import subprocess

    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('triton'))"],
                         capture_output=True, text=True, check=True).stdout
    return Version(out.strip())


def self_check(archs: Iterable[int] = (80, 86, 89, 90, 100, 120), kernels: Iterable[str] = ("probe_add", "probe_dot"),
               python: str | None = None) -> list[dict[str, Any]]:
    """Compile each probe kernel for each arch, each in its own subprocess; one summary dict per compile."""
    return [probe_subprocess(k, a, python=python) for a in archs for k in kernels]


if __name__ == "__main__":  # child entry of probe_subprocess: prints one json line
    _k, _a, _w, _s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(probe(_k, _a, _w, _s)))

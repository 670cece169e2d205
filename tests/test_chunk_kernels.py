"""Interpreter tests of the chunked DPLR kernels (templates/chunk_dplr.py.jinja + dplr_gen/chunk_driver.py)
against the float64 reference recurrence and its autograd gradients.

Runs on CPU with TRITON_INTERPRET=1, in fp32 (ieee dots) and fp16 (the interpreter computes bf16 tl.dot
wrongly). Every run draws fresh random inputs and prints its seed; outputs and scratch buffers are filled
with NaN before each launch, so an element a kernel does not write fails the check.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any triton import

import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import jinja2  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from triton.runtime import interpreter as _interpreter  # noqa: E402

from dplr_gen import chunk_driver  # noqa: E402
from dplr_gen.reference import naive_dplr_delta_rule  # noqa: E402
from dplr_gen.testing import rel_err, rwkv7_inputs  # noqa: E402


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into Python ints with int(),
    which numpy >= 2.4 refuses for arrays of ndim 1: `for i in range(n)` with n computed from a program id
    then fails. Use the single element instead (test-only patch, active while a kernel is interpreted)."""
    orig = _interpreter._patch_lang_tensor
    if getattr(orig, "_dplr_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._dplr_patched = True
    _interpreter._patch_lang_tensor = patched


_patch_interpreter_index()

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "chunk_dplr.py.jinja"
TORCH_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "fp16": 3e-3}
NAMES = ("o", "ht", "q", "k", "v", "a", "b", "gk", "h0")


class DevKernelSet:
    """Minimal kernel set: launches module kernels with the variant's constexprs and launch options."""

    def __init__(self, module):
        self.m = module

    def constexprs(self, name):
        return dict(self.m.CONSTEXPRS[name])

    def __getattr__(self, name):
        fn = getattr(self.m, name)
        c = self.m.CONSTEXPRS[name]
        launch = self.m.LAUNCH[name]

        class _G:
            def __getitem__(_, grid):
                return lambda *args: fn[grid](*args, **c, **launch)

        return _G()


def make_variant(dtype="fp32", K=32, V=None, chunk_size=16, varlen=False, gate_bound=-0.6065,
                 gate_dtype=None, dot_precision="ieee"):
    V = K if V is None else V
    name = f"chunk_{dtype}_k{K}_v{V}_c{chunk_size}_{'varlen' if varlen else 'dense'}_gb{gate_bound}"
    return SimpleNamespace(name=name, op="chunk", dtype=dtype, gate_dtype=gate_dtype or dtype, K=K, V=V,
                           chunk_size=chunk_size, varlen=varlen, gate_bound=gate_bound, state_dtype="fp32",
                           dot_precision=dot_precision if dtype == "fp32" else None)


def knobs(block_v=None, block_k=None, num_warps=4, num_stages=1):
    return SimpleNamespace(block_v=block_v, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def render(v, tune=None, flags=None) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(REPO / "templates"), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    tune = tune or {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs()}
    flags = flags or SimpleNamespace(no_mma_chaining=False, separate_accumulators=False)
    return env.get_template(TEMPLATE).render(v=v, tune=tune, flags=flags, header=f"# test render: {v.name}")


_MODULES: dict[str, object] = {}
_TMP = Path(tempfile.mkdtemp(prefix="chunk_dplr_test_"))


def load(v, tune=None, flags=None) -> DevKernelSet:
    src = render(v, tune, flags)
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    if key not in _MODULES:
        path = _TMP / f"chunk_dplr_{key}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"chunk_dplr_{key}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        _MODULES[key] = mod
    return DevKernelSet(_MODULES[key])


def run_case(v, B=1, T=37, H=2, lens=None, extreme=False, with_h0=True, tune=None, flags=None, seed=None):
    """Forward + backward through the kernels vs float64 autograd of the reference; returns {name: rel err}."""
    seed = random.randrange(2**31) if seed is None else seed
    print(f"seed={seed} variant={v.name} B={B} T={T} H={H} lens={lens} extreme={extreme} flags={flags}")
    torch.manual_seed(seed)
    cu = None
    if lens is not None:
        B, T = 1, sum(lens)
        cu = torch.tensor([0] + list(itertools_accumulate(lens)), dtype=torch.int32)
    gb = v.gate_bound if v.gate_bound is not None else -2.0
    d = rwkv7_inputs(B, T, H, v.K, v.V, dtype=torch.float64, seed=seed, gate_bound=gb)
    N = B if cu is None else len(lens)
    h0 = torch.randn(N, H, v.K, v.V, dtype=torch.float64) * 0.5 if with_h0 else torch.zeros(N, H, v.K, v.V,
                                                                                             dtype=torch.float64)
    if extreme:  # full resets and no-decay channels
        g = d["gk"]
        g[torch.rand_like(g) < 0.08] = -math.inf
        g[torch.rand_like(g) < 0.08] = 0.0
        g[:, ::7, :, : v.K // 2] = -math.inf
        g[:, 3::5, :, v.K // 3:] = 0.0
    dt, gdt = TORCH_DT[v.dtype], TORCH_DT[v.gate_dtype]
    x = {n: d[n].to(dt) for n in ("q", "k", "v", "a", "b")}
    x["gk"] = d["gk"].to(gdt)
    scale = v.K**-0.5
    # the reference sees exactly the rounded inputs
    leaves = {n: x[n].double().requires_grad_(True) for n in ("q", "k", "v", "a", "b", "gk")}
    leaves["h0"] = h0.clone().requires_grad_(True)
    o_ref, ht_ref = naive_dplr_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                                          leaves["gk"], scale, leaves["h0"], True, cu)
    do = torch.randn_like(o_ref)
    dht = torch.randn_like(ht_ref)
    grads = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), list(leaves.values()))
    ref = {"o": o_ref, "ht": ht_ref, **dict(zip(leaves.keys(), grads))}

    ks = load(v, tune, flags)
    chunk_driver.POISON = True
    try:
        o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], scale,
                                                    h0.float(), cu)
        dq, dk, dv, da, db, dg, dh0 = chunk_driver.chunk_dplr_bwd(ks, v, saved, do.to(dt), dht.float())
    finally:
        chunk_driver.POISON = False
    assert o.dtype == dt and ht.dtype == torch.float32 and dg.dtype == gdt and dh0.dtype == torch.float32
    out = {"o": o, "ht": ht, "q": dq, "k": dk, "v": dv, "a": da, "b": db, "gk": dg, "h0": dh0}
    errs = {n: rel_err(out[n], ref[n]) for n in NAMES}
    print("  " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    return errs


def itertools_accumulate(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def check(errs, tol):
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad}"

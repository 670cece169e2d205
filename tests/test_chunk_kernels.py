"""Interpreter tests of the chunked DPLR kernels (dplr_gen/render/templates/chunk_dplr.py.jinja + dplr_gen/runtime/chunk_driver.py)
against the float64 reference recurrence and its autograd gradients.

Runs on CPU with TRITON_INTERPRET=1, in fp32 (ieee dots) and fp16 (the interpreter computes bf16 tl.dot
wrongly). Every run draws fresh random inputs and prints its seed; outputs and scratch buffers are filled
with NaN before each launch, so an element a kernel does not write fails the check.

On a GPU machine, `CHUNK_TEST_DEVICE=cuda pytest tests/test_chunk_kernels.py` runs the same checks on
compiled kernels (JIT, no interpreter), bf16 included; CHUNK_TEST_ARCH_FLAGS=1 then renders with the flags of
the GPU's architecture (no_mma_chaining from sm_90, separate_accumulators from sm_100) wherever a test does not
pick flags itself.
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("CHUNK_TEST_DEVICE", "cpu")
# before any triton import (the repo's conftest only sets a default: compiled kernels on a GPU need "0")
os.environ["TRITON_INTERPRET"] = "1" if DEVICE == "cpu" else "0"

import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from dplr_gen.plan.chunk_plan import plan_chunk  # noqa: E402
from dplr_gen.render.render import environment  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


from dplr_gen.runtime import chunk_driver  # noqa: E402
from dplr_gen.reference import naive_dplr_delta_rule  # noqa: E402
from dplr_gen.testing import rel_err, rwkv7_inputs  # noqa: E402


if DEVICE == "cpu":
    from dplr_gen.runtime.loader import interpreter_numpy_compat  # noqa: E402

    interpreter_numpy_compat()

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "chunk_dplr.py.jinja"
TORCH_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "fp16": 3e-3, "bf16": 1e-2}
DTYPES = ["fp32", "fp16"] + (["bf16"] if DEVICE != "cpu" else [])
NAMES = ("o", "ht", "q", "k", "v", "a", "b", "gk", "h0")


class DevKernelSet:
    """Minimal kernel set: launches module kernels with the variant's constexprs and launch options."""

    def __init__(self, module):
        self.m = module

    def constexprs(self, name):
        return dict(self.m.CONSTEXPRS[name])

    def has(self, name):
        return name in self.m.SIGNATURES

    def arguments(self, name):
        return self.m.SIGNATURES[name].keys()

    def option(self, name, default=None):
        return getattr(self.m, "OPTIONS", {}).get(name, default)

    def warps(self, name):
        return self.m.LAUNCH[name]["num_warps"]

    def resident_per_sm(self, name, device):
        return None  # compiled at run time: unknown, as runtime.KernelSet says of such kernels

    def __getattr__(self, name):
        fn = getattr(self.m, name)
        if DEVICE == "cpu":  # the interpreter runs no Gluon: a Gluon kernel's Triton form (runtime.KernelSet)
            fn = getattr(self.m, "TRITON_FORMS", {}).get(name, fn)
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


ARCH_BIG_SMEM = SimpleNamespace(smem_per_block=232448)  # sm_90's: the template's default tiles are the widest


def knobs(block_v=None, block_k=None, num_warps=4, num_stages=1, chunk=None, overlap=None, max_registers=None,
          states_every=None, launch_below_sms=None, segments=None, lazy_exact_gates=None, divisible_t=None,
          split_exact=None):
    return SimpleNamespace(block_v=block_v, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                           chunk=chunk, overlap=overlap, max_registers=max_registers, states_every=states_every,
                           launch_below_sms=launch_below_sms, segments=segments, lazy_exact_gates=lazy_exact_gates,
                           divisible_t=divisible_t, split_exact=split_exact)


def render(v, tune=None, flags=None, arch=ARCH_BIG_SMEM) -> str:
    env = environment()  # the generator's own strict environment, with its globals
    tune = tune or {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs()}
    flags = flags or _default_flags()
    return env.get_template(TEMPLATE).render(v=v, tune=tune, flags=flags, arch=arch, plan=plan_chunk(v, arch, tune),
                                             header=f"# test render: {v.name}")


def _default_flags():
    if DEVICE != "cpu" and os.environ.get("CHUNK_TEST_ARCH_FLAGS") == "1":
        cc = torch.cuda.get_device_capability()
        return SimpleNamespace(no_mma_chaining=cc >= (9, 0), separate_accumulators=cc >= (10, 0),
                               gluon_token_pass=False, split_tf32x3=False)
    return SimpleNamespace(no_mma_chaining=False, separate_accumulators=False, gluon_token_pass=False, split_tf32x3=False)


_MODULES: dict[str, object] = {}
_TMP = Path(tempfile.mkdtemp(prefix="chunk_dplr_test_"))


def load(v, tune=None, flags=None, arch=ARCH_BIG_SMEM) -> DevKernelSet:
    src = render(v, tune, flags, arch)
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


def run_case(v, B=1, T=37, H=2, lens=None, extreme=False, with_h0=True, tune=None, flags=None, seed=None,
             keep_states=True, scale=None, gates=None, prep_for_bwd=False):
    """Forward + backward through the kernels vs float64 autograd of the reference; returns {name: rel err}.
    keep_states=False: the training path, whose backward recomputes the states from its own prep's W and M.
    scale: the output scale (default K^-0.5). gates: a function that edits gk [B, T, H, K] in place."""
    seed = random.randrange(2**31) if seed is None else seed
    shape = f"B={B} T={T}" if lens is None else f"lens={lens}"
    print(f"seed={seed} variant={v.name} {shape} H={H} extreme={extreme} flags={flags}")
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
    if gates is not None:
        gates(d["gk"])
    dt, gdt = TORCH_DT[v.dtype], TORCH_DT[v.gate_dtype]
    x = {n: d[n].to(dt) for n in ("q", "k", "v", "a", "b")}
    x["gk"] = d["gk"].to(gdt)
    scale = v.K**-0.5 if scale is None else scale
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
    x = {n: t.to(DEVICE) for n, t in x.items()}
    cu = None if cu is None else cu.to(DEVICE)
    with chunk_driver.forced(poison=True):
        o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], scale,
                                                    h0.float().to(DEVICE), cu, keep_states, prep_for_bwd)
        dq, dk, dv, da, db, dg, dh0 = chunk_driver.chunk_dplr_bwd(ks, v, saved, do.to(dt).to(DEVICE),
                                                                  dht.float().to(DEVICE))
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


FLAGS_AMPERE = SimpleNamespace(no_mma_chaining=False, separate_accumulators=False, gluon_token_pass=False, split_tf32x3=False)
FLAGS_HOPPER = SimpleNamespace(no_mma_chaining=True, separate_accumulators=False, gluon_token_pass=False, split_tf32x3=False)
FLAGS_BLACKWELL = SimpleNamespace(no_mma_chaining=True, separate_accumulators=True, gluon_token_pass=False, split_tf32x3=False)


# ---------------------------------------------------------------- rendering contract (no kernel runs)

def _kernel_params(mod, name):
    import inspect

    fn = getattr(mod, name)
    fn = getattr(fn, "fn", fn)
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("gate_bound", [-0.6065, -1.0, None])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_render_contract(dtype, varlen, gate_bound, chunk_size):
    v = make_variant(dtype, K=100, V=60, chunk_size=chunk_size, varlen=varlen, gate_bound=gate_bound,
                     dot_precision="tf32")
    tune = {"fwd": knobs(block_v=32, num_warps=4, num_stages=2), "bwd": knobs(num_warps=2, num_stages=1)}
    for flags in (FLAGS_AMPERE, FLAGS_BLACKWELL):
        src = render(v, tune, flags)  # "bwd_dh" missing from tune: it falls back to the "bwd" knobs
        assert src.startswith(f"# test render: {v.name}\n")
        assert src == render(v, tune, flags)  # byte-identical
        compile(src, "rendered", "exec")
    mod = load(v, tune, FLAGS_HOPPER).m
    assert set(mod.SIGNATURES) == set(mod.CONSTEXPRS) == set(mod.LAUNCH) == {
        chunk_driver.PREP, chunk_driver.FWD, chunk_driver.FWD_H, chunk_driver.PREP_BWD, chunk_driver.BWD_DH,
        chunk_driver.BWD}
    io = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}[dtype]
    for name, sig in mod.SIGNATURES.items():
        params = _kernel_params(mod, name)
        cs = mod.CONSTEXPRS[name]
        assert params == list(sig) + list(cs), name  # runtime args in order, then the constexprs
        assert [t for n, t in sig.items() if n in ("q", "k", "v", "a", "b", "w", "m", "qw", "kwt", "bwt", "do")] \
            == [io] * len(set(sig) & {"q", "k", "v", "a", "b", "w", "m", "qw", "kwt", "bwt", "do"}) and sig["T"] == "i32"
        assert sig.get("gk", io) == io and sig.get("egc", "*fp32") == "*fp32"  # e^gamma_C is kept in fp32
        assert ("cu_seqlens" in sig) == varlen
        assert cs["K"] == 100 and cs["BC"] == chunk_size and cs["BK"] == 128
        assert cs.get("V", 60) == 60
        assert all(isinstance(x, (int, float, bool, str)) for x in cs.values())
    # the block_v knob is honoured, except that chunk 64 keeps V tiles >= 64 (sm_90 miscompiles narrower ones)
    assert mod.CONSTEXPRS[chunk_driver.FWD]["BV"] == (32 if chunk_size < 64 else 64)
    assert mod.LAUNCH[chunk_driver.FWD] == mod.LAUNCH[chunk_driver.FWD_H] == {"num_warps": 4, "num_stages": 2}
    assert mod.LAUNCH[chunk_driver.PREP] == {"num_warps": 4, "num_stages": 2}  # no "prep" knobs: the fwd ones
    assert mod.LAUNCH[chunk_driver.BWD_DH] == {"num_warps": 2, "num_stages": 1}
    factored = gate_bound is not None and chunk_size * -gate_bound / 2 <= 30
    assert ("bounded, factored exponents" in src) == factored
    # any other gate mode chooses per chunk at run time between the factored and the exact form
    assert ("def _chunk_A_exact" in src and "if _factorable(" in src) == (not factored)


@pytest.mark.parametrize("K,V,bv,bv_bwd_99kb", [(32, 128, 64, 16), (64, 64, 64, 16), (100, 60, 32, 16),
                                                (128, 256, 32, 16), (192, 160, 16, 16), (256, 256, 16, 16),
                                                (256, 20, 16, 16)])
def test_default_v_tiles(K, V, bv, bv_bwd_99kb):
    """Default V tiles keep the [BK, BV] state tile at 4096 elements; under 128 KB of shared memory the
    chunk-parallel backward takes 16. Explicit knobs win (test_render_contract)."""
    v = make_variant("bf16", K=K, V=V, gate_bound=-0.61)
    big = load(v).m.CONSTEXPRS
    assert [big[n]["BV"] for n in (chunk_driver.FWD, chunk_driver.BWD_DH, chunk_driver.BWD)] == [bv] * 3
    small = load(v, arch=SimpleNamespace(smem_per_block=101376)).m.CONSTEXPRS
    assert [small[n]["BV"] for n in (chunk_driver.FWD, chunk_driver.BWD_DH, chunk_driver.BWD)] == [
        bv, bv, bv_bwd_99kb]


def test_chunk_map():
    C = 16
    lens = [1, 15, 16, 17, 64, 100, 3]
    cu = torch.tensor([0] + list(itertools_accumulate(lens)), dtype=torch.int32, device=DEVICE)
    n_slots = int(cu[-1]) // C + len(lens)
    m = chunk_driver.chunk_map_from_cu_seqlens(cu, C, n_slots)
    want = {}
    for n, L in enumerate(lens):
        for i in range(-(-L // C)):
            want[(int(cu[n]) + i * C) // C + n] = (n, i)
    assert len(want) == sum(-(-L // C) for L in lens)  # slots unique
    for s in range(n_slots):
        if s in want:
            assert tuple(m[s].tolist()) == want[s]  # noqa: B023
        else:
            assert m[s, 1].item() == -1


# ---------------------------------------------------------------- numerics against the float64 reference

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,V,C,T,H", [(32, 32, 16, 37, 2), (60, 20, 32, 45, 1), (32, 48, 64, 100, 1)])
def test_bounded(dtype, K, V, C, T, H):
    check(run_case(make_variant(dtype, K=K, V=V, chunk_size=C), T=T, H=H), TOL[dtype])


@pytest.mark.parametrize("flags", [FLAGS_HOPPER, FLAGS_BLACKWELL], ids=["hopper", "blackwell"])
@pytest.mark.parametrize("dtype,gate_bound", [("fp32", -0.6065), ("fp16", -1.0), ("fp32", None)])
def test_arch_flags(flags, dtype, gate_bound):
    v = make_variant(dtype, K=32, V=16, chunk_size=32, gate_bound=gate_bound)
    check(run_case(v, T=40, H=1, flags=flags, extreme=gate_bound is None), TOL[dtype])


@pytest.mark.parametrize("C,gate_bound", [(32, -1.0), (64, -1.0)], ids=["factored", "exact"])
def test_bounded_gate_below_bound_is_clamped(C, gate_bound):
    # gk below the declared bound (even -inf) is clamped to it in both code paths: finite, and equal to the
    # recurrence run with the clamped gate
    v = make_variant("fp32", K=16, V=16, chunk_size=C, gate_bound=gate_bound)
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    d = rwkv7_inputs(1, 70, 1, 16, 16, dtype=torch.float64, seed=seed)
    d["gk"][0, ::3] = -math.inf
    d["gk"][0, 1::3] = -30.0
    leaves = {n: d[n].clone().requires_grad_(True) for n in ("q", "k", "v", "a", "b", "gk", "initial_state")}
    args = [leaves[n] for n in ("q", "k", "v", "a", "b")]
    o_ref, ht_ref = naive_dplr_delta_rule(*args, leaves["gk"].clamp(min=gate_bound), 1.0, leaves["initial_state"],
                                          True)
    do, dht = torch.randn_like(o_ref), torch.randn_like(ht_ref)
    ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), list(leaves.values()))
    x = {n: d[n].float().to(DEVICE) for n in leaves}
    ks = load(v)
    o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, *[x[n] for n in ("q", "k", "v", "a", "b", "gk")], 1.0,
                                                x["initial_state"], None)
    grads = chunk_driver.chunk_dplr_bwd(ks, v, saved, do.float().to(DEVICE), dht.float().to(DEVICE))
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5
    for name, gr, r in zip(leaves, grads, ref):
        assert rel_err(gr, r) <= 1e-5, name


SMALL = {"fwd": knobs(block_v=32, num_warps=2, num_stages=2), "bwd_dh": knobs(block_v=32, num_warps=2),
         "bwd": knobs(block_v=16, num_warps=4), "fwd_small": knobs(block_v=16, num_warps=4, num_stages=2),
         "bwd_dh_small": knobs(block_v=16, num_warps=1, num_stages=1)}


def test_small_grid_kernels_declared():
    mod = load(make_variant("fp32", K=32, V=48), SMALL).m
    small = {"chunk_dplr_fwd_small_kernel", "chunk_dplr_fwd_h_small_kernel", "chunk_dplr_bwd_dh_small_kernel"}
    assert small <= set(mod.SIGNATURES) == set(mod.CONSTEXPRS) == set(mod.LAUNCH)
    for name in small:
        wide = name.replace("_small_kernel", "_kernel")
        assert mod.SIGNATURES[name] == mod.SIGNATURES[wide]
        assert _kernel_params(mod, name) == list(mod.SIGNATURES[name]) + list(mod.CONSTEXPRS[name])
        assert mod.CONSTEXPRS[name] == {**mod.CONSTEXPRS[wide], "BV": 16}
    assert mod.LAUNCH["chunk_dplr_fwd_small_kernel"] == {"num_warps": 4, "num_stages": 2}
    assert mod.LAUNCH["chunk_dplr_bwd_dh_small_kernel"] == {"num_warps": 1, "num_stages": 1}
    assert not small & set(load(make_variant("fp32", K=32, V=48)).m.SIGNATURES)  # only where tuned


@pytest.mark.parametrize("varlen", [False, True])
def test_small_grid_kernels(monkeypatch, varlen):
    # the small-grid copies (V tile 16 instead of 32: three V blocks) give the reference's results
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(small_grid=True))
    v = make_variant("fp32", K=32, V=48, varlen=varlen)
    kw = {"lens": [5, 40, 17]} if varlen else {"B": 2, "T": 40}
    check(run_case(v, H=2, tune=SMALL, **kw), TOL["fp32"])


T16 = {**SMALL, "fwd_small": knobs(block_v=16, num_warps=4, num_stages=2, divisible_t=True),
       "bwd_dh_small": knobs(block_v=16, num_warps=1, num_stages=1, divisible_t=True)}


def test_divisible_t_copies_declared_and_launched_where_t_allows(monkeypatch):
    """Knob divisible_t: the small-grid kernels declared once more under *_t16_kernel names (the same functions,
    signatures, constexprs and launch options, DIVISIBLE naming T), dense variants only; the driver launches that
    build of a kernel exactly where T is a multiple of 16, with the same results."""
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(small_grid=True))
    mod = load(make_variant("fp32", K=32, V=48), T16).m
    small = ("chunk_dplr_fwd_small_kernel", "chunk_dplr_fwd_h_small_kernel", "chunk_dplr_bwd_dh_small_kernel")
    twins = {n: n.replace("_kernel", "_t16_kernel") for n in small}
    assert mod.OPTIONS["divisible_t"] == twins and mod.DIVISIBLE == {t: ("T",) for t in twins.values()}
    for name, twin in twins.items():
        assert getattr(mod, twin) is getattr(mod, name)
        assert (mod.SIGNATURES[twin], mod.CONSTEXPRS[twin], mod.LAUNCH[twin]) == (
            mod.SIGNATURES[name], mod.CONSTEXPRS[name], mod.LAUNCH[name])
    assert "divisible_t" not in load(make_variant("fp32", K=32, V=48, varlen=True), T16).m.OPTIONS
    assert "DIVISIBLE" not in vars(load(make_variant("fp32", K=32, V=48), SMALL).m)

    launched = []
    real = DevKernelSet.__getattr__

    def spy(self, name):
        launched.append(name)
        return real(self, name)

    monkeypatch.setattr(DevKernelSet, "__getattr__", spy)
    v = make_variant("fp32", K=32, V=48)
    for T, expect in ((32, set(twins.values())), (40, set(small))):
        launched.clear()
        check(run_case(v, B=2, T=T, H=2, tune=T16, keep_states=False), TOL["fp32"])
        assert {n for n in launched if "_small" in n} == expect, (T, launched)


def test_small_grid_choice(monkeypatch):
    """By the device: the small copy only when the wide grid has fewer programs than SMs."""
    ks = load(make_variant("fp32", K=32, V=48), SMALL)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert chunk_driver._pass_kernel(ks, chunk_driver.FWD, 2, 48, cpu) == (chunk_driver.FWD, 32)
    monkeypatch.setattr(chunk_driver, "_sm_count", lambda index: 132)
    assert chunk_driver._pass_kernel(ks, chunk_driver.FWD, 65, 48, gpu) == ("chunk_dplr_fwd_small_kernel", 16)
    assert chunk_driver._pass_kernel(ks, chunk_driver.BWD_DH, 66, 48, gpu) == (chunk_driver.BWD_DH, 32)
    plain = load(make_variant("fp32", K=32, V=48))
    assert chunk_driver._pass_kernel(plain, chunk_driver.FWD_H, 1, 48, gpu) == (
        chunk_driver.FWD_H, plain.constexprs(chunk_driver.FWD_H)["BV"])



def test_small_grid_choice_below_a_multiple_of_the_sms(monkeypatch):
    """Knob launch_below_sms: the copy up to that many times the SMs (here 4 for the states passes' copy, the
    reverse pass's default 1), for the forward's and the states-only pass alike."""
    ks = load(make_variant("fp32", K=32, V=48), {**SMALL, "fwd_small": knobs(block_v=16, num_warps=4, num_stages=2,
                                                                          launch_below_sms=4)})
    assert ks.option("small_grid_below_sms") == {chunk_driver.FWD: 4, chunk_driver.FWD_H: 4, chunk_driver.BWD_DH: 1}
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(chunk_driver, "_sm_count", lambda index: 132)
    for name in (chunk_driver.FWD, chunk_driver.FWD_H):  # two V tiles of 32: 2 NH programs
        assert chunk_driver._pass_kernel(ks, name, 263, 48, gpu)[0] == name.replace("_kernel", "_small_kernel")
        assert chunk_driver._pass_kernel(ks, name, 264, 48, gpu) == (name, 32)
    assert chunk_driver._pass_kernel(ks, chunk_driver.BWD_DH, 65, 48, gpu)[0] == "chunk_dplr_bwd_dh_small_kernel"
    assert chunk_driver._pass_kernel(ks, chunk_driver.BWD_DH, 66, 48, gpu) == (chunk_driver.BWD_DH, 32)
    # a grid whose programs hold the device for part of the pass (varlen, mixed lengths) counts at that share
    assert chunk_driver._pass_kernel(ks, chunk_driver.FWD, 264, 48, gpu, busy=0.99)[0] == "chunk_dplr_fwd_small_kernel"
    assert chunk_driver._pass_kernel(ks, chunk_driver.FWD, 704, 48, gpu, busy=0.36)[0] == "chunk_dplr_fwd_small_kernel"
    assert chunk_driver._pass_kernel(ks, chunk_driver.FWD, 704, 48, gpu, busy=0.4) == (chunk_driver.FWD, 32)


def test_varlen_forward_counts_its_grid_at_the_occupancy(monkeypatch):
    """The forward's pass (alone on the device) counts a varlen grid at the occupancy of the starts read on the
    host; the backward's passes (the states pass beside the reverse pass) count every program."""
    chosen = []
    real = chunk_driver._pass_kernel

    def spy(ks, name, NH, V, device, busy=1.0):
        chosen.append((name, busy))
        return real(ks, name, NH, V, device, busy)

    monkeypatch.setattr(chunk_driver, "_pass_kernel", spy)
    v = make_variant("fp32", K=32, V=48, varlen=True)
    ks = load(v)
    offsets = [0, 16, 64, 144]
    T, H = offsets[-1], 2
    q, k, a, b = (torch.randn(1, T, H, 32) * 0.3 for _ in range(4))
    vv = torch.randn(1, T, H, 48)
    gk = -torch.rand(1, T, H, 32) * 0.5
    cu = torch.tensor(offsets, dtype=torch.int32)
    h0 = torch.zeros(3, H, 32, 48)
    o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, q, k, vv, a, b, gk, 1.0, h0, cu, False, offsets=offsets)
    saved["offsets"] = offsets  # as the eager op hands them to the backward
    chunk_driver.chunk_dplr_bwd(ks, v, saved, torch.randn_like(o), torch.randn_like(ht))
    busy = dict(chosen)
    assert busy[chunk_driver.FWD] == pytest.approx(144 / (3 * 80))
    assert busy[chunk_driver.FWD_H] == 1.0 and busy[chunk_driver.BWD_DH] == 1.0


SEGMENTED = {**SMALL, "fwd_small": knobs(block_v=16, num_warps=4, num_stages=2, segments=8),
             "bwd_dh_small": knobs(block_v=16, num_warps=1, num_stages=1, segments=8)}


@pytest.mark.parametrize("dtype,K,V,B,T,count,keep", [
    ("fp32", 32, 48, 2, 100, 3, True),    # 7 chunks: segments of 3, 3, 1
    ("fp32", 32, 48, 1, 160, 4, False),   # 10 chunks: 3, 3, 3, 1; the backward recomputes the states
    ("fp16", 48, 32, 2, 70, 2, True),     # K under its 64-wide tile
    ("fp32", 32, 48, 1, 64, 4, True),     # one chunk a segment
], ids=["fp32-3", "fp32-4-recompute", "fp16-k48", "fp32-1-chunk"])
def test_state_passes_over_segments(monkeypatch, dtype, K, V, B, T, count, keep):
    """Knob segments (chunk.fwd_small, chunk.bwd_dh_small): the segments' maps, then the pass over each segment
    from the state the maps of the segments before it (after it, for the reverse pass) give, match the reference
    (o, the final state, and the gradients through the kept or recomputed states), NaN-poisoned; every state
    pass ran over segments (forward, reverse, and the recompute's states pass)."""
    seen = []
    rule = chunk_driver.segments
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(segments=count))
    monkeypatch.setattr(chunk_driver, "segments", lambda *a, **kw: seen.append(rule(*a, **kw)) or seen[-1])
    v = make_variant(dtype, K=K, V=V)
    check(run_case(v, B=B, T=T, H=2, tune=SEGMENTED, keep_states=keep), TOL[dtype])
    NT = -(-T // 16)
    per = -(-NT // count)
    assert len(seen) == (2 if keep else 3) and all(s == (-(-NT // per), per) for s in seen), seen


def test_segments_rule(monkeypatch):
    """At least three segments of SEGMENT_MIN_CHUNKS chunks, the pass's grid within SEGMENT_WARPS_PER_SM warps and
    SEGMENT_PROGRAMS_PER_SM programs per SM, at most the knob's count, and only where the small-grid copy was chosen and the variant has
    the segmented pass."""
    ks = load(make_variant("fp32", K=32, V=48), SEGMENTED)
    assert ks.option("segments") == 8 and {chunk_driver.SEG_MAPS, chunk_driver.FWD_SEG} <= set(ks.m.SIGNATURES)
    for name in (chunk_driver.SEG_MAPS, chunk_driver.FWD_SEG, chunk_driver.FWD_H_SEG, chunk_driver.SEG_MAPS_BWD,
                 chunk_driver.BWD_DH_SEG):  # each declared signature is its kernel's parameter list
        assert _kernel_params(ks.m, name) == list(ks.m.SIGNATURES[name]) + list(ks.m.CONSTEXPRS[name]), name
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(chunk_driver, "_sm_count", lambda index: 132)
    small = "chunk_dplr_fwd_small_kernel"
    assert chunk_driver.segments(ks, small, 8, 4096, gpu) == (8, 32)       # (1, 4096, 2, 128)
    # the forward's copy runs 4 warps: 2 programs per SM
    assert chunk_driver.segments(ks, small, 64, 2048, gpu) == (4, 32)      # (2, 2048, 8, 128): 264 // 64
    assert chunk_driver.segments(ks, small, 100, 4096, gpu) is None        # two segments would not gain
    # a pass alone on the device (the forward's) may hold 8 programs an SM where 4 leave fewer than 3 segments;
    # the forward's copy here runs 4 warps: 2 programs an SM either way
    assert chunk_driver.segments(ks, small, 100, 4096, gpu, alone=True) is None
    assert chunk_driver.segments(ks, small, 64, 2048, gpu, alone=True) == (4, 32)  # as without: 4 already
    # the reverse pass's copy runs 1 warp: 4 programs per SM
    rev = "chunk_dplr_bwd_dh_small_kernel"
    assert chunk_driver.segments(ks, rev, 100, 4096, gpu, "segments_bwd") == (5, 52)  # 528 // 100
    # (4, 4096, 32, 64)'s 256 one-warp programs: none beside another pass, 4 alone (8 an SM)
    assert chunk_driver.segments(ks, rev, 256, 4096, gpu, "segments_bwd") is None
    assert chunk_driver.segments(ks, rev, 256, 4096, gpu, "segments_bwd", alone=True) == (4, 64)
    assert chunk_driver.segments(ks, rev, 600, 4096, gpu, "segments_bwd", alone=True) is None  # 1056 // 600
    assert chunk_driver.segments(ks, small, 8, 800, gpu) == (3, 17)        # 50 chunks: 3 of 16 at most
    assert chunk_driver.segments(ks, small, 8, 700, gpu) is None           # 44 chunks: 2 of 16 at most
    assert chunk_driver.segments(ks, chunk_driver.FWD, 8, 4096, gpu) is None
    assert chunk_driver.segments(ks, small, 8, 4096, torch.device("cpu")) is None
    assert chunk_driver.segments(load(make_variant("fp32", K=32, V=48), SMALL), small, 8, 4096, gpu) is None
    assert chunk_driver.segments(ks, "chunk_dplr_bwd_dh_small_kernel", 8, 4096, gpu, "segments_bwd") == (8, 32)
    only_fwd = {**SEGMENTED, "bwd_dh_small": SMALL["bwd_dh_small"]}
    assert chunk_driver.segments(load(make_variant("fp32", K=32, V=48), only_fwd), "chunk_dplr_bwd_dh_small_kernel",
                                 8, 4096, gpu, "segments_bwd") is None
    assert "chunk_dplr_fwd_seg_kernel" not in load(make_variant("fp32", K=32, V=48, varlen=True), SEGMENTED).m.SIGNATURES


def _token_chunk_knobs(tc, block_v=None):
    return {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_v=block_v, chunk=tc)}


@pytest.mark.parametrize("dtype,C,TC,gate_bound,kw", [
    ("fp32", 16, 32, -0.6065, {"B": 2, "T": 75}),
    ("fp16", 16, 64, -0.6065, {"B": 1, "T": 150}),
    ("fp32", 16, 32, -0.6065, {"lens": [1, 15, 16, 17, 33, 64, 47]}),
    ("fp32", 32, 64, None, {"lens": [5, 31, 64, 70]}),
], ids=["dense-32", "dense-64-fp16", "varlen-32", "varlen-64-anygate"])
def test_token_pass_longer_chunks(dtype, C, TC, gate_bound, kw):
    """Knob chunk.bwd.chunk: the token pass walks TC-token chunks over the C-chunk passes' U and dR, the states
    kept only at TC boundaries (varlen: sequence ends inside a TC chunk, sequences shorter than C)."""
    v = make_variant(dtype, K=32, V=32, chunk_size=C, varlen="lens" in kw, gate_bound=gate_bound)
    tune = _token_chunk_knobs(TC, block_v=16)
    mod = load(v, tune).m
    assert mod.CONSTEXPRS[chunk_driver.BWD]["BC"] == TC and mod.CONSTEXPRS[chunk_driver.FWD]["BC"] == C
    check(run_case(v, H=2, tune=tune, extreme=gate_bound is None, **kw), TOL[dtype])


@pytest.mark.parametrize("dtype,K,BK,TC,gate_bound,kw", [
    ("fp32", 32, 16, 16, -0.6065, {"B": 2, "T": 45}),
    ("fp16", 48, 16, 32, -0.6065, {"B": 1, "T": 70}),
    ("fp32", 32, 16, 16, -0.6065, {"lens": [1, 15, 16, 17, 33, 40]}),
    ("fp32", 32, 16, 32, None, {"lens": [5, 31, 50]}),
], ids=["dense", "dense-fp16-K48-tc32", "varlen", "varlen-anygate-tc32"])
def test_token_pass_k_blocks(dtype, K, BK, TC, gate_bound, kw):
    """Knob chunk.bwd.block_k: the token pass's K columns over cdiv(K, BK) programs per chunk (each forms the
    dA matrices in full; K = 48 leaves a partial last block); dk and dq are then never written over dR and U."""
    v = make_variant(dtype, K=K, V=32, chunk_size=16, varlen="lens" in kw, gate_bound=gate_bound)
    tune = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_k=BK, block_v=16, chunk=TC)}
    mod = load(v, tune).m
    assert mod.CONSTEXPRS[chunk_driver.BWD]["BK"] == BK and mod.CONSTEXPRS[chunk_driver.FWD]["BK"] >= K
    check(run_case(v, H=2, tune=tune, extreme=gate_bound is None, **kw), TOL[dtype])


@pytest.mark.parametrize("dtype,K,BK,gate_bound,keep,kw", [
    ("fp32", 32, 32, -0.6065, True, {"B": 2, "T": 75}),
    ("fp32", 32, 16, -0.6065, False, {"B": 2, "T": 64}),
    ("fp16", 48, 16, -0.6065, False, {"B": 1, "T": 70}),
    ("fp32", 32, 16, -0.6065, True, {"lens": [1, 15, 16, 17, 33, 48, 40]}),
    ("fp32", 32, 32, None, False, {"lens": [5, 31, 50, 16]}),
], ids=["dense-odd-chunks", "dense-recomputed-kblocks", "dense-fp16-K48", "varlen", "varlen-anygate-recomputed"])
def test_token_pass_derives_states(dtype, K, BK, gate_bound, keep, kw):
    """Knob chunk.bwd.states_every = 2 C: h and dh kept every 2 C tokens, the C-token token pass deriving the state
    entering each odd chunk and dS leaving each even one (a sequence's last chunk even: its kept dS is its own);
    with the forward's saved states and with the backward's recomputed ones, K whole or in blocks."""
    v = make_variant(dtype, K=K, V=32, chunk_size=16, varlen="lens" in kw, gate_bound=gate_bound)
    tune = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_k=BK, block_v=16, states_every=32)}
    ks = load(v, tune)
    assert chunk_driver.token_chunk(ks) == 16 and chunk_driver.states_every(ks) == 32
    assert chunk_driver.derives_states(ks) and "_kept_step" in ks.m.__dict__
    check(run_case(v, H=2, tune=tune, extreme=gate_bound is None, keep_states=keep, **kw), TOL[dtype])


@pytest.mark.parametrize("derive", [False, True])
def test_backward_prep_without_the_states_pass_operands(derive):
    """Where the forward kept the states (no states pass in the backward), the backward's prep neither allocates
    nor writes W, M and, unless the token pass derives states with it, (B e^..)^T; what it does write is the
    same to the bit. Checked on NaN-poisoned buffers, so a masked-off store that leaked would show."""
    v = make_variant("fp32", K=32, V=32, chunk_size=16)
    tune = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_v=16, states_every=32 if derive else None)}
    ks = load(v, tune)
    x = {n: t.to(DEVICE) for n, t in rwkv7_inputs(2, 45, 2, 32, 32, dtype=torch.float32).items()}
    args = (ks, v, x["q"], x["k"], x["a"], x["b"], x["gk"], None, 2 * 3)  # slots: 2 sequences x 3 chunks
    with chunk_driver.forced(poison=True):
        full = chunk_driver.chunk_prep(*args, for_bwd=True)
        lean = chunk_driver.chunk_prep(*args, for_bwd=True, pass_ops=False)
    assert lean.w is None and lean.m is None and (lean.bwt is not None) == derive
    for name in chunk_driver.Prep._fields:
        a, b = getattr(full, name), getattr(lean, name)
        if b is not None:
            assert not a.isnan().any() and torch.equal(a, b), name


@pytest.mark.parametrize("derive,lens,gate_bound", [(False, None, -0.6065), (True, [5, 31, 50, 16], -0.6065),
                                                     (False, [1, 17, 40], None)],
                         ids=["dense", "varlen-deriving", "varlen-anygate"])
def test_forward_runs_the_backward_prep(monkeypatch, derive, lens, gate_bound):
    """prep_for_bwd: the forward that keeps the states runs the backward's prep (which also writes the forward's
    operands) and the backward runs none. o, the final state and every gradient are those of the forward and
    backward that each run their own prep, to the bit, on NaN-poisoned buffers; what the forward keeps of that
    prep holds no W and M (nor (B e^..)^T unless the token pass derives states with it)."""
    v = make_variant("fp32", K=32, V=32, chunk_size=16, varlen=lens is not None, gate_bound=gate_bound)
    tune = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_v=16, states_every=32 if derive else None)}
    ks = load(v, tune)
    torch.manual_seed(7)
    B, T = (2, 45) if lens is None else (1, sum(lens))
    cu = None if lens is None else torch.tensor([0, *itertools_accumulate(lens)], dtype=torch.int32).to(DEVICE)
    N = B if lens is None else len(lens)
    x = {n: t.to(DEVICE) for n, t in rwkv7_inputs(B, T, 2, 32, 32, dtype=torch.float32).items()}
    h0 = torch.randn(N, 2, 32, 32, device=DEVICE)
    do, dht = torch.randn_like(x["v"]), torch.randn_like(h0)
    runs = []
    real = chunk_driver.chunk_prep
    monkeypatch.setattr(chunk_driver, "chunk_prep",
                        lambda *a, **k: runs.append(k.get("for_bwd", False)) or real(*a, **k))
    out = {}
    with chunk_driver.forced(poison=True):
        for prep_for_bwd in (False, True):
            runs.clear()
            o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, *[x[n] for n in ("q", "k", "v", "a", "b", "gk")], 0.3,
                                                        h0, cu, True, prep_for_bwd)
            pr = saved["prep"]
            assert (pr is not None) == prep_for_bwd and runs == [prep_for_bwd]
            if pr is not None:
                assert pr.w is None and pr.m is None and pr.fwd is None and (pr.bwt is not None) == derive
            out[prep_for_bwd] = (o, ht, *chunk_driver.chunk_dplr_bwd(ks, v, saved, do, dht))
            assert runs == ([True] if prep_for_bwd else [False, True]) and "prep" not in saved
    for name, a, b in zip(NAMES, out[False], out[True]):
        assert not a.isnan().any() and torch.equal(a, b), name


def test_shared_prep_refuses_inconsistent_requests():
    """The forward's operands come only from the full backward prep, and only a forward that keeps the states
    runs it: the other combinations are refused with the argument named, before any launch."""
    v = make_variant("fp32", K=16, V=16, chunk_size=16)
    ks = load(v)
    x = rwkv7_inputs(1, 20, 1, 16, 16, dtype=torch.float32)
    args = (ks, v, x["q"], x["k"], x["a"], x["b"], x["gk"], None, 2)
    with pytest.raises(ValueError, match="fwd_ops"):
        chunk_driver.chunk_prep(*args, fwd_ops=True)
    with pytest.raises(ValueError, match="fwd_ops"):
        chunk_driver.chunk_prep(*args, for_bwd=True, pass_ops=False, fwd_ops=True)
    with pytest.raises(ValueError, match="prep_for_bwd"):
        chunk_driver.chunk_dplr_fwd(ks, v, *[x[n] for n in ("q", "k", "v", "a", "b", "gk")], 1.0,
                                    torch.zeros(1, 1, 16, 16), None, False, True)


def test_forward_runs_the_backward_prep_against_the_reference():
    """The same path against the float64 reference (fp16, varlen, any gate: the exact form's branch too)."""
    v = make_variant("fp16", K=32, V=32, chunk_size=16, varlen=True, gate_bound=None)
    check(run_case(v, H=2, lens=[3, 33, 20], extreme=True, prep_for_bwd=True), TOL["fp16"])


def test_token_pass_derives_states_scale_zero():
    """scale = 0 (a valid, finite scale): the derived dS steps with scale times dO's product, never through a
    division by it."""
    v = make_variant("fp32", K=32, V=32, chunk_size=16)
    tune = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_v=16, states_every=32)}
    check(run_case(v, B=1, T=64, H=1, tune=tune, keep_states=False, scale=0.0), TOL["fp32"])


def test_states_every_shapes_the_states():
    """h and dh hold one state per states_every tokens, and the token pass refuses to run without the prep's
    operands it derives the others from."""
    v = make_variant("fp32", K=16, V=16, chunk_size=16)
    ks = load(v, {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(states_every=32)})
    x = rwkv7_inputs(2, 70, 1, 16, 16)
    assert chunk_driver.states_shape(ks, v, x["q"], 16, None) == (2 * 3, 1, 16, 16)
    assert not chunk_driver.derives_states(load(v))
    with pytest.raises(ValueError, match="steps: 0 tensors given"):
        chunk_driver.chunk_dplr_bwd_tokens(ks, v, {"q": x["q"], "k": x["k"], "v": x["v"], "a": x["a"],
                                                   "b": x["b"], "gk": x["gk"], "scale": 1.0, "cu_seqlens": None,
                                                   "n_tslots": 10}, *[None] * 5)


@pytest.mark.parametrize("K,gate_bound", [(100, -0.6065), (100, None), (64, -0.6065)],
                         ids=["K100-w-last", "K100-anygate-w-last", "K64"])
def test_prep_bwd_w_order(K, gate_bound):
    """The backward's prep writes W after the reverse pass's products where its tiles are 128 wide (K > 64),
    before them otherwise: both orders give the gradients of the float64 reference."""
    v = make_variant("fp32", K=K, V=32, chunk_size=16, gate_bound=gate_bound)
    assert bool(load(v).m.PREP_BWD_W_LAST) == (K > 64)
    check(run_case(v, B=1, T=40, H=1, extreme=gate_bound is None, keep_states=False), TOL["fp32"])


def test_token_pass_k_blocks_never_alias(monkeypatch):
    """With K split over programs, a program may still read a chunk's dR and U rows after another has written
    its dk and dq columns: the driver then hands the token pass fresh buffers even where asked to alias."""
    v = make_variant("fp32", K=32, V=32, chunk_size=16)
    ks = load(v, {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_k=16)})
    x = {n: t.to(DEVICE) for n, t in rwkv7_inputs(1, 37, 2, 32, 32, dtype=torch.float32).items()}
    h0 = torch.randn(1, 2, 32, 32, device=DEVICE)
    o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, *[x[n] for n in ("q", "k", "v", "a", "b", "gk")], 0.5,
                                                h0, None, keep_states=True)
    pr = chunk_driver.chunk_prep(ks, v, x["q"], x["k"], x["a"], x["b"], x["gk"], None, saved["n_slots"],
                                 for_bwd=True)
    h, u, _ = chunk_driver.chunk_states(ks, v, saved, pr)
    do = torch.randn_like(o)
    dh, dr, _, _ = chunk_driver.chunk_dplr_bwd_dh(ks, v, saved, pr, do, None)
    dr0, u0 = dr.clone(), u.clone()
    out = chunk_driver.chunk_dplr_bwd_tokens(ks, v, saved, h, u, do, dh, dr, dk_over_dr=True, dq_over_u=True)
    assert out[1].data_ptr() != dr.data_ptr() and out[0].data_ptr() != u.data_ptr()
    assert torch.equal(dr, dr0) and torch.equal(u, u0)


@pytest.mark.parametrize("varlen, derive", [(False, False), (True, False), (False, True)])
def test_persistent_token_pass_declares_its_item_count(varlen, derive):
    """Where the token pass is the persistent Gluon kernel (flag gluon_token_pass), its signature ends in n_items
    and OPTIONS lists it as persistent; the driver passes the count of work items, and its Triton form (the
    interpreter's stand-in, a program per item) gives exactly the plain unit's gradients: the K = 64 form (a state
    per chunk) and the deriving form of K = 128 (here at K = 32 in K blocks of 16, states every 32 tokens)."""
    K = 32 if derive else 64
    v = make_variant("fp32", K=K, V=K, chunk_size=16, varlen=varlen, gate_bound=-0.61)
    tune = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_k=16, block_v=16, states_every=32)} if derive \
        else None
    gluon = SimpleNamespace(no_mma_chaining=True, separate_accumulators=False, gluon_token_pass=True, split_tf32x3=False)
    ks, ks_g = load(v, tune), load(v, tune, flags=gluon)
    assert chunk_driver.derives_states(ks_g) == derive
    assert list(ks_g.m.SIGNATURES[chunk_driver.BWD])[-1] == "n_items" and "n_items" not in ks.m.SIGNATURES[chunk_driver.BWD]
    assert ks_g.option("persistent") == [chunk_driver.BWD] and ks.option("persistent") == []
    cu = torch.tensor([0, 5, 21, 41], dtype=torch.int32).to(DEVICE) if varlen else None
    d = rwkv7_inputs(1, 41 if varlen else 37, 2, K, K, dtype=torch.float32)
    x = {n: t.to(DEVICE) for n, t in d.items()}
    h0 = torch.randn(3 if varlen else 1, 2, K, K, device=DEVICE)
    o, _, saved = chunk_driver.chunk_dplr_fwd(ks, v, *[x[n] for n in ("q", "k", "v", "a", "b", "gk")], 0.5, h0, cu,
                                              keep_states=True)
    do = torch.randn_like(o)
    pr = chunk_driver.chunk_prep(ks, v, x["q"], x["k"], x["a"], x["b"], x["gk"], cu, saved["n_slots"],
                                 for_bwd=True, chunk_map=saved["chunk_map"])
    h, u, _ = chunk_driver.chunk_states(ks, v, saved, pr)
    dh, dr, _, _ = chunk_driver.chunk_dplr_bwd_dh(ks, v, saved, pr, do, None)
    steps = chunk_driver.state_step_operands(pr) if derive else ()
    with chunk_driver.forced(poison=True):
        plain = chunk_driver.chunk_dplr_bwd_tokens(ks, v, saved, h, u, do, dh, dr, steps=steps)
        persistent = chunk_driver.chunk_dplr_bwd_tokens(ks_g, v, saved, h, u, do, dh, dr, steps=steps)
    for n, a, b in zip(("q", "k", "a", "b", "gk"), plain, persistent):
        assert not a.isnan().any() and torch.equal(a, b), n


@pytest.mark.parametrize("varlen, keep_states, strided, derive",
                         [(False, False, False, False), (True, False, False, False), (False, True, False, False),
                          (False, False, True, False), (True, False, True, False), (False, False, False, True),
                          (False, False, True, True)])
def test_split_token_pass_takes_every_chunk_once(varlen, keep_states, strided, derive, monkeypatch):
    """An any-gate variant with the Gluon token pass splits that pass by chunk: the backward's prep flags each
    chunk whose gates allow the factored form (1) or not (0), the persistent kernel takes the 1s and the Triton
    form the 0s. Its gradients equal the one-kernel pass's exactly, on gates that give both kinds of chunk
    (resets to -inf, a steep run, RWKV-7's slow gates), with every buffer poisoned; a chunk that neither kernel
    took would stay NaN. Varlen: also as the dense twin's split pass launched per sequence. Strided: the Triton
    form's persistent programs fewer than its blocks of flags (2 programs, blocks of 2 flags), as on a device;
    otherwise one block, mostly past the end. Derive: the deriving form of K = 128 (here at K = 32 in K blocks of
    16, states every 32 tokens: two work items a chunk). The split pass refuses to run without the flags."""
    K = 32 if derive else 64
    v = make_variant("fp32", K=K, V=K, chunk_size=16, varlen=varlen, gate_bound=None)
    tune = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(block_k=16, block_v=16, states_every=32)} if derive \
        else None
    gluon = SimpleNamespace(no_mma_chaining=True, separate_accumulators=False, gluon_token_pass=True, split_tf32x3=False)
    ks, ks_s = load(v, tune), load(v, tune, flags=gluon)
    assert chunk_driver.derives_states(ks_s) == derive
    split = chunk_driver.split_kernel(ks_s)
    assert chunk_driver.split_kernel(ks) is None and split == "chunk_dplr_bwd_triton_kernel"
    assert split in ks_s.option("persistent")
    if strided:
        launch = chunk_driver.persistent_launch
        monkeypatch.setattr(ks_s.m, "FLAG_BLOCK", tl.constexpr(2))
        monkeypatch.setattr(chunk_driver, "persistent_launch", lambda ks, name, n, dev: (
            (2, [n]) if name == split else launch(ks, name, n, dev)))
    assert list(ks_s.m.SIGNATURES["chunk_dplr_prep_bwd_kernel"]).count("fac") == 1
    cu = torch.tensor([0, 5, 40, 77], dtype=torch.int32).to(DEVICE) if varlen else None
    T = 77 if varlen else 70
    d = rwkv7_inputs(1, T, 2, K, K, dtype=torch.float32)
    gk = d["gk"]
    gk[:, 20] = float("-inf")  # a reset: that chunk takes the exact form
    gk[:, 48:64, 0] = -5.0  # a steep run of one head: exponents past the factored form's limit
    x = {n: t.to(DEVICE) for n, t in d.items()}
    h0 = torch.randn(3 if varlen else 1, 2, K, K, device=DEVICE)
    inputs = [x[n] for n in ("q", "k", "v", "a", "b", "gk")]
    # varlen: also as the dense twin's split pass per sequence (the ops' choice for few long sequences)
    twin = load(make_variant("fp32", K=K, V=K, chunk_size=16, gate_bound=None), flags=gluon) if varlen else None
    grads = []
    for kset, per_seq in ((ks, None), (ks_s, False), *([(ks_s, True)] if varlen else [])):
        with chunk_driver.forced(poison=True, per_sequence=per_seq):
            o, ht, saved = chunk_driver.chunk_dplr_fwd(kset, v, *inputs, 0.5, h0, cu, keep_states=keep_states)
            if per_seq:
                saved.update(twin=twin, offsets=cu.tolist())
            torch.manual_seed(1)
            do, dht = torch.randn_like(o), torch.randn_like(ht)
            grads.append(chunk_driver.chunk_dplr_bwd(kset, v, saved, do, dht))
    with chunk_driver.forced(poison=True):
        pr = chunk_driver.chunk_prep(ks_s, v, *[x[n] for n in ("q", "k", "a", "b", "gk")], cu, saved["n_slots"],
                                     for_bwd=True, chunk_map=saved["chunk_map"])
    assert set(pr.fac.flatten().tolist()) == {0, 1}, pr.fac  # both kernels have chunks to take
    for n, a, *others in zip(("q", "k", "v", "a", "b", "gk", "h0"), *grads):
        assert all(not b.isnan().any() and torch.equal(a, b) for b in others), n
    with pytest.raises(ValueError, match=r"fac: this variant's token pass is split by chunk"):
        chunk_driver.chunk_dplr_bwd_tokens(ks_s, v, saved, None, None, None, None, None,
                                           steps=chunk_driver.state_step_operands(pr) if derive else ())


def test_persistent_launch_grid(monkeypatch):
    """A persistent kernel gets min(items, resident programs an SM * SMs) programs where its binary's residency
    is known, else its residency at the most registers a thread may use, and n_items as its last argument; on
    the CPU (the interpreter) one program per item; any other kernel one program per item and no argument."""
    class KS:
        def __init__(self, persistent, resident):
            self.persistent, self.resident = persistent, resident

        def option(self, name, default=None):
            return self.persistent if name == "persistent" else default

        def resident_per_sm(self, name, device):
            return self.resident

        def resident_floor(self, name, device):
            return 1

    monkeypatch.setattr(chunk_driver, "_device_sms", lambda device: 132)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    k = chunk_driver.BWD
    assert chunk_driver.persistent_launch(KS([k], 2), k, 100000, gpu) == (264, [100000])
    assert chunk_driver.persistent_launch(KS([k], 2), k, 200, gpu) == (200, [200])
    assert chunk_driver.persistent_launch(KS([k], None), k, 100000, gpu) == (132, [100000])
    assert chunk_driver.persistent_launch(KS([k], None), k, 100, gpu) == (100, [100])
    assert chunk_driver.persistent_launch(KS([k], 2), k, 100000, cpu) == (100000, [100000])
    assert chunk_driver.persistent_launch(KS([], 2), k, 100000, gpu) == (100000, [])


def test_resident_floor_is_what_the_most_registers_allow(monkeypatch):
    """A kernel whose binary is not known: the programs an SM holds at 255 registers a thread and its warps (two
    of a 4-warp kernel, eight of a 1-warp one), at least one (16 warps at 255 registers fit none)."""
    from types import SimpleNamespace

    from dplr_gen.runtime import loader

    monkeypatch.setattr(loader, "_sm_limits", lambda device: {"regs_sm": 65536, "threads_sm": 2048, "smem_sm": 233472})
    module = SimpleNamespace(LAUNCH={"a": {"num_warps": 4}, "b": {"num_warps": 1}, "c": {"num_warps": 16}})
    ks = loader.KernelSet(module, None)
    gpu = torch.device("cuda", 0)
    assert [ks.resident_floor(n, gpu) for n in "abc"] == [2, 8, 1]
    assert ks.resident_per_sm("a", gpu) is None  # no binary: unknown, the floor is the caller's choice


def test_token_pass_chunk_sizes_the_states():
    """h and dh hold one state per TC-token chunk: TC / C times fewer than per C-token chunk."""
    v = make_variant("fp32", K=16, V=16, chunk_size=16)
    x = rwkv7_inputs(2, 70, 1, 16, 16)
    for tc, n in ((16, 2 * 5), (32, 2 * 3), (64, 2 * 2)):
        ks = load(v, _token_chunk_knobs(tc))
        assert chunk_driver.token_chunk(ks) == tc
        assert chunk_driver.states_shape(ks, v, x["q"], 16, None) == (n, 1, 16, 16)
        cu = torch.tensor([0, 10, 70, 140], dtype=torch.int32)
        assert chunk_driver.states_shape(ks, v, x["q"].reshape(1, 140, 1, 16), 16, cu)[0] == 140 // tc + 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_token(dtype):
    check(run_case(make_variant(dtype, K=16, V=32, chunk_size=16), B=2, T=1, H=2), TOL[dtype])


def test_batch_heads_vblocks():
    # several sequences and heads, V split into 3 blocks in every kernel, no initial state
    v = make_variant("fp32", K=16, V=48, chunk_size=16)
    tune = {s: knobs(block_v=16) for s in ("fwd", "bwd_dh", "bwd")}
    check(run_case(v, B=2, T=20, H=3, tune=tune, with_h0=False), TOL["fp32"])


@pytest.mark.parametrize("dtype,C", [("fp32", 16), ("fp16", 32)] + ([("bf16", 64)] if DEVICE != "cpu" else []))
def test_varlen(dtype, C):
    v = make_variant(dtype, K=32, V=16, chunk_size=C, varlen=True)
    check(run_case(v, lens=[1, 15, 16, 17, 64, 100], H=1), TOL[dtype])


@pytest.mark.parametrize("dtype,C", [("fp32", 16), ("fp16", 16), ("fp32", 32)])
def test_generic_gate_extremes(dtype, C):
    # gk = -inf (full reset) and gk = 0 (no decay) at many positions and channels
    v = make_variant(dtype, K=16, V=32, chunk_size=C, gate_bound=None)
    check(run_case(v, T=50, H=1, extreme=True), TOL[dtype])


# any-gate variants take the factored form in each chunk whose exponents allow it and the exact one elsewhere
# (_factorable in the template): chunks of mild decays, steep decays (16 tokens of -5: exponents up to 40 from
# the middle row) and resets in one sequence
def _mixed_gates(g):
    g[:, 16:32] = -5.0
    g[:, 40, :, ::2] = -math.inf
    g[:, 70:90, :, 1::3] = -3.0


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_generic_gate_mixed_chunks(dtype):
    v = make_variant(dtype, K=16, V=32, chunk_size=16, gate_bound=None)
    check(run_case(v, T=100, H=2, gates=_mixed_gates), TOL[dtype])


@triton.jit
def _nan_chunk_A(q, k, a, b, g, gam, gamp, BC: tl.constexpr):
    z = tl.zeros([BC, BC], dtype=tl.float32) + float("nan")
    return z, z, z, z


@triton.jit
def _nan_intra_bwd(dAqk, dAqb, dAak, dAab, q, k, a, b, g, gam, gamp, BC: tl.constexpr):
    z = q * float("nan")
    return z, z, z, z, z, z


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces a device function of the interpreted module")
@pytest.mark.parametrize("form, gates", [("exact", None), ("factored", lambda g: g.clamp_(max=-2.5))])
def test_generic_gate_form_taken(monkeypatch, form, gates):
    """Which form a chunk takes: with the other form's functions replaced by NaN producers the results stay
    exact, so mild decays (RWKV-7's, >= -0.61) never ran the row-by-row form and steep ones (-2.5 on every
    token: exponents up to 40 from the middle row at chunk 32, beyond FACTOR_LIMIT) never ran the factored one."""
    v = make_variant("fp32", K=16, V=16, chunk_size=32, gate_bound=None)
    m = load(v).m
    monkeypatch.setattr(m, f"_chunk_A_{form}", _nan_chunk_A)
    monkeypatch.setattr(m, f"_intra_bwd_{form}", _nan_intra_bwd)
    # two whole chunks (a short last chunk of steep decays would be factorable). Steep decays (taken row by row)
    # leave dgk a few times fp32's usual rounding (median 4.6e-6 over 60 seeds, tail past 1e-5), so their
    # bound is 3x fp32's; a wrong form gives NaN either way.
    tol = TOL["fp32"] * (1 if gates is None else 3)
    check(run_case(v, T=64, H=1, gates=gates), tol)
    # and the replacement does reach the kernels: the other gates produce NaN
    other = (lambda g: g.clamp_(max=-2.5)) if gates is None else None
    errs = run_case(v, T=64, H=1, gates=other)
    assert any(not e <= TOL["fp32"] for e in errs.values()), errs


# knob chunk.prep.lazy_exact_gates: the factored form's differences of the gate sums, the exact sums only in the
# chunks that cannot factor (every kernel of the unit; the prep loads the gates first)
LAZY = {"fwd": knobs(), "bwd_dh": knobs(), "bwd": knobs(), "prep": knobs(lazy_exact_gates=True)}


@pytest.mark.parametrize("dtype, varlen", [("fp32", False), ("fp16", False), ("fp32", True)])
def test_lazy_exact_gates_mixed_and_extreme_chunks(dtype, varlen):
    """With the knob, chunks of mild decays, steep decays, resets and no-decay channels in one sequence (both
    forms, and the exact sums reached through the second load) match float64 as tightly as without it."""
    v = make_variant(dtype, K=16, V=32, chunk_size=16, varlen=varlen, gate_bound=None)
    src = render(v, LAZY)
    assert "if not _factorable(gam, gamp, g.shape[0]):" in src and src != render(v)
    if varlen:
        check(run_case(v, lens=[1, 16, 17, 30, 36], H=2, extreme=True, tune=LAZY), TOL[dtype])
    else:
        check(run_case(v, T=100, H=2, gates=_mixed_gates, tune=LAZY), TOL[dtype])
        check(run_case(v, T=50, H=1, extreme=True, tune=LAZY), TOL[dtype])


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces a device function of the interpreted module")
def test_lazy_exact_gates_sum_exactly_where_the_chunk_cannot_factor(monkeypatch):
    """The exact sums are reached: with the factored form's functions replaced by NaN producers, resets and
    steep decays in every chunk (none can factor) still give float64's results, and RWKV-7's mild gates (every
    chunk factors) do not (so the replacement reaches the kernels and mild chunks take the differences)."""
    v = make_variant("fp32", K=16, V=16, chunk_size=16, gate_bound=None)
    m = load(v, LAZY).m
    monkeypatch.setattr(m, "_chunk_A_factored", _nan_chunk_A)
    monkeypatch.setattr(m, "_intra_bwd_factored", _nan_intra_bwd)

    def resets(g):
        g[:, ::16, :, :] = -math.inf  # the first token of every chunk: no chunk's exponents are finite

    check(run_case(v, T=64, H=1, gates=resets, tune=LAZY), TOL["fp32"])
    errs = run_case(v, T=64, H=1, tune=LAZY)
    assert any(not e <= TOL["fp32"] for e in errs.values()), errs


# knob chunk.prep.split_exact (with the lazy sums, as Hopper's any-gate variants take it): each prep a factored-form
# kernel flagging its chunks, then a persistent exact-form kernel for the chunks flagged 0
SPLIT_PREP = {**LAZY, "prep": knobs(lazy_exact_gates=True, split_exact=True)}


def _prep_outputs(pr):
    return {f: t for f, t in pr._asdict().items() if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("dtype, varlen, programs, K, delta", [
    ("fp32", False, None, 16, False), ("fp16", False, 3, 16, False), ("fp32", True, 2, 16, False),
    ("fp32", False, 2, 20, True)])
def test_split_prep_equals_the_single_kernel(dtype, varlen, programs, K, delta, monkeypatch):
    """Split by chunk, both preps write what the single lazy-sum kernel writes, bit for bit, into NaN-poisoned
    buffers (so every element is written by one of the two kernels), on chunks of mild and steep decays, resets
    and no-decay channels; the flags say which chunks may factor. ``programs``: the exact kernel given fewer
    programs than (chunk, head) pairs, each walking several (as the device's persistent launch does). ``delta``:
    delta-rule inputs (b = -a) at an odd head dim. Dense fp32: the whole forward and backward match too."""
    v = make_variant(dtype, K=K, V=32, chunk_size=16, varlen=varlen, gate_bound=None)
    one, two = load(v, LAZY), load(v, SPLIT_PREP)
    exact = "chunk_dplr_prep_exact_kernel", "chunk_dplr_prep_bwd_exact_kernel"
    assert two.option("split_exact") == dict(zip(("chunk_dplr_prep_kernel", "chunk_dplr_prep_bwd_kernel"), exact))
    assert one.option("split_exact") is None and all(n in two.option("persistent") for n in exact)
    assert "n_items" in two.arguments(exact[0]) and "fac" in two.arguments("chunk_dplr_prep_kernel")
    if programs is not None:
        grid = chunk_driver.persistent_launch
        monkeypatch.setattr(chunk_driver, "persistent_launch", lambda ks, name, n, dev: (
            (programs, [n]) if name in exact else grid(ks, name, n, dev)))
    lens = [1, 16, 17, 30, 36] if varlen else None
    T = sum(lens) if varlen else 100
    cu = torch.tensor([0, *itertools_accumulate(lens)], dtype=torch.int32).to(DEVICE) if varlen else None
    d = rwkv7_inputs(1, T, 2, K, 32, dtype=torch.float32, gate_bound=-2.0)
    if delta:
        d["b"] = -d["a"]
    _mixed_gates(d["gk"])
    d["gk"][:, 48:64:7, :, :8] = -math.inf  # resets in one chunk; no decay in some channels everywhere
    d["gk"][:, 3::5, :, 5:] = 0.0
    x = {n: d[n].to(TORCH_DT[dtype]).to(DEVICE) for n in ("q", "k", "a", "b", "gk")}
    n_slots = chunk_driver._layout(16, x["q"], cu)[1]
    for for_bwd in (False, True):
        with chunk_driver.forced(poison=True):
            got = [chunk_driver.chunk_prep(ks, v, *x.values(), cu, n_slots, for_bwd=for_bwd) for ks in (one, two)]
        a, b = (_prep_outputs(pr) for pr in got)
        assert a.keys() == b.keys() - {"fac"}
        for f in a:
            assert torch.equal(a[f].nan_to_num(7.0), b[f].nan_to_num(7.0)), (for_bwd, f)
            assert not b[f].isnan().any() or f in ("x4", "x5", "x6"), (for_bwd, f)
        if for_bwd:
            flags = b["fac"]
            assert flags.unique().tolist() == [0, 1]  # both forms taken
    if programs is None:  # the whole forward and backward (the preps' outputs above are all the rest reads)
        ref = run_case(v, T=T, H=2, extreme=True, tune=LAZY, seed=5)
        assert run_case(v, T=T, H=2, extreme=True, tune=SPLIT_PREP, seed=5) == ref


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces a device function of the interpreted module")
def test_split_prep_exact_kernel_takes_only_the_flagged_chunks(monkeypatch):
    """The exact kernels compute only the chunks flagged 0: with the exact form's A matrices replaced by NaN
    producers RWKV-7's mild gates (every chunk factors) stay exact, and with the factored form's replaced, resets
    in every chunk still do (neither kernel takes the other's chunks)."""
    v = make_variant("fp32", K=16, V=16, chunk_size=16, gate_bound=None)
    m = load(v, SPLIT_PREP).m
    monkeypatch.setattr(m, "_chunk_A_exact", _nan_chunk_A)
    check(run_case(v, T=64, H=1, tune=SPLIT_PREP), TOL["fp32"])
    monkeypatch.undo()
    monkeypatch.setattr(m, "_chunk_A_factored", _nan_chunk_A)
    monkeypatch.setattr(m, "_intra_bwd_factored", _nan_intra_bwd)

    def resets(g):
        g[:, ::16, :, :] = -math.inf

    check(run_case(v, T=64, H=1, gates=resets, tune=SPLIT_PREP), TOL["fp32"])


def test_kernel_profile_counts_the_chunks_flagged_for_the_exact_form():
    """scripts/kernel_profile.py's exact_chunks: on RWKV-7's mild gates no (chunk, head) pair is flagged for the
    exact form, with a reset in one chunk of one head that one; a bounded variant flags nothing (None)."""
    spec = importlib.util.spec_from_file_location("kernel_profile", REPO / "scripts" / "kernel_profile.py")
    kp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kp)
    v = make_variant("fp32", K=16, V=16, chunk_size=16, gate_bound=None)
    ks = load(v, SPLIT_PREP)
    d = rwkv7_inputs(1, 64, 2, 16, 16, dtype=torch.float32)
    x = {"r": d["q"], "k": d["k"], "a": d["a"], "b": d["b"], "w": d["gk"]}
    x = {n: t.to(DEVICE) for n, t in x.items()}
    got = kp.exact_chunks(ks, v, x)
    assert (got["flagged"], got["of"]) == (0, 8), got
    assert set(got["resident_per_sm"]) == {"chunk_dplr_prep_exact_kernel", "chunk_dplr_prep_bwd_exact_kernel"}, got
    x["w"][0, 37, 1, 3] = -math.inf
    assert kp.exact_chunks(ks, v, x)["flagged"] == 1
    bounded = make_variant("fp32", K=16, V=16, chunk_size=16)
    assert kp.exact_chunks(load(bounded), bounded, x) is None


def test_generic_gate_varlen():
    v = make_variant("fp32", K=16, V=16, chunk_size=16, varlen=True, gate_bound=None)
    check(run_case(v, lens=[1, 16, 17, 30], H=1, extreme=True), TOL["fp32"])


def test_gate_dtype_fp32_with_fp16_inputs():
    v = make_variant("fp16", K=32, V=32, chunk_size=16, gate_dtype="fp32")
    check(run_case(v, T=33, H=1), TOL["fp16"])


@pytest.mark.parametrize("varlen, K", [(False, 16), (True, 32)])
def test_dk_dq_written_over_dr_u(varlen, K):
    """chunk_dplr_bwd lets the token pass write dk over dR and dq over U where they have the same shape (K = V):
    the same bits as into fresh NaN-poisoned buffers (which shows that every element is written), and the
    buffers handed back are dR's and U's own."""
    v = make_variant("fp32", K=K, V=32, chunk_size=16, varlen=varlen)
    ks = load(v)
    lens = [5, 16, 20] if varlen else None
    T = sum(lens) if varlen else 37
    cu = torch.tensor([0, 5, 21, 41], dtype=torch.int32).to(DEVICE) if varlen else None
    d = rwkv7_inputs(1, T, 2, K, 32, dtype=torch.float32)
    d["initial_state"] = torch.randn(3 if varlen else 1, 2, K, 32)
    x = {n: t.to(DEVICE) for n, t in d.items()}
    o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, *[x[n] for n in ("q", "k", "v", "a", "b", "gk")], 0.5,
                                                x["initial_state"], cu)
    do = torch.randn_like(o)
    pr = chunk_driver.chunk_prep(ks, v, x["q"], x["k"], x["a"], x["b"], x["gk"], cu, saved["n_slots"],
                                 for_bwd=True, chunk_map=saved["chunk_map"])
    h, u, _ = chunk_driver.chunk_states(ks, v, saved, pr)
    dh, dr, _, _ = chunk_driver.chunk_dplr_bwd_dh(ks, v, saved, pr, do, torch.randn_like(ht))
    with chunk_driver.forced(poison=True):
        fresh = chunk_driver.chunk_dplr_bwd_tokens(ks, v, saved, h, u, do, dh, dr)
    assert not any(g.isnan().any() for g in fresh)
    dr_ptr, u_ptr = dr.data_ptr(), u.data_ptr()
    over = chunk_driver.chunk_dplr_bwd_tokens(ks, v, saved, h, u, do, dh, dr, dk_over_dr=True,
                                              dq_over_u=True)
    assert (over[1].data_ptr() == dr_ptr) == (K == 32) and (over[0].data_ptr() == u_ptr) == (K == 32)
    for n, a, b in zip(("q", "k", "a", "b", "gk"), fresh, over):
        assert torch.equal(a, b), n


def test_no_dht():
    # dht=None: gradients through the output only
    v = make_variant("fp32", K=16, V=16, chunk_size=16)
    ks = load(v)
    d = rwkv7_inputs(1, 21, 1, 16, 16, dtype=torch.float64)
    leaves = {n: d[n].clone().requires_grad_(True) for n in ("q", "k", "v", "a", "b", "gk", "initial_state")}
    o_ref, _ = naive_dplr_delta_rule(*[leaves[n] for n in ("q", "k", "v", "a", "b", "gk")], 0.5,
                                     leaves["initial_state"], True)
    do = torch.randn_like(o_ref)
    ref = torch.autograd.grad((o_ref * do).sum(), list(leaves.values()))
    x = {n: d[n].float().to(DEVICE) for n in leaves}
    o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, v, *[x[n] for n in ("q", "k", "v", "a", "b", "gk")], 0.5,
                                                x["initial_state"], None)
    grads = chunk_driver.chunk_dplr_bwd(ks, v, saved, do.float().to(DEVICE), None)
    assert rel_err(o, o_ref) <= 1e-5
    for gr, r in zip(grads, ref):
        assert rel_err(gr, r) <= 1e-5


# ---------------------------------------------------------------- longer runs

@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_slow_large_heads(dtype):
    v = make_variant(dtype, K=128, V=100, chunk_size=64)
    check(run_case(v, B=1, T=150, H=2), TOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_slow_generic_chunk64(dtype):
    v = make_variant(dtype, K=32, V=32, chunk_size=64, gate_bound=None)
    check(run_case(v, T=140, H=1, extreme=True), TOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [FLAGS_AMPERE, FLAGS_BLACKWELL], ids=["ampere", "blackwell"])
def test_slow_varlen_many(flags):
    v = make_variant("fp16", K=64, V=64, chunk_size=64, varlen=True)
    check(run_case(v, lens=[1, 63, 64, 65, 200, 7, 128], H=2, flags=flags), TOL["fp16"])


@pytest.mark.slow
def test_slow_long_sequence_fp32():
    # many chunks: state passing over 16 chunk boundaries, gate bound -1 at chunk 32
    v = make_variant("fp32", K=32, V=32, chunk_size=32, gate_bound=-1.0)
    check(run_case(v, B=2, T=500, H=1), TOL["fp32"])


def test_overlap_choice(monkeypatch):
    """The backward's states pass goes beside the reverse pass (a second stream) only where the variant's knob
    asks for it and both grids are resident at once: H100's 132 SMs, the K=64 passes at 1 warp with 204 and
    224 registers (9 programs an SM each): (4,4096,32,64) has 256 programs a pass, (8,4096,64,64) 1024."""
    from dplr_gen.runtime.loader import blocks_per_sm

    assert blocks_per_sm(204, 8192, 1) == blocks_per_sm(224, 8192, 1) == 9  # registers in 256-per-warp units
    assert blocks_per_sm(255, 34816, 4) == 2  # the token pass: two blocks an SM
    assert blocks_per_sm(64, 40000, 1, smem_sm=233472) == 5  # shared memory binds
    assert blocks_per_sm(16, 0, 1) == 32 and blocks_per_sm(255, 0, 16) == 0
    assert chunk_driver.grids_fit([(256, 9), (256, 9)], 132) and not chunk_driver.grids_fit([(1024, 9), (1024, 9)], 132)
    assert not chunk_driver.grids_fit([(8, 4), (8, None)], 132)  # residency unknown (run-time compiled): no

    monkeypatch.setattr(chunk_driver, "_sm_count", lambda index: 132)
    monkeypatch.setattr(chunk_driver, "_capturing", lambda: False)

    def ks(knob):
        return SimpleNamespace(option=lambda name, default=None: knob if name == "overlap_state_passes" else default,
                               has=lambda name: False, constexprs=lambda name: {"BV": 32},
                               resident_per_sm=lambda name, device: 9)

    def q(B, H, cuda=True):
        return SimpleNamespace(is_cuda=cuda, shape=(B, 4096, H, 64), device=torch.device("cuda" if cuda else "cpu", 0))

    assert chunk_driver._overlap(ks(True), q(4, 32), 4, 64)
    assert not chunk_driver._overlap(ks(True), q(8, 64), 8, 64)  # each pass fills the device alone
    assert not chunk_driver._overlap(ks(False), q(4, 32), 4, 64)  # the knob off
    assert not chunk_driver._overlap(ks(True), q(4, 32, cuda=False), 4, 64)  # streams are CUDA's
    # host-bound steps (few token-heads) keep one stream: the fork and join cost more host time than they save
    assert chunk_driver._overlap(ks(True), q(1, 32), 1, 64)  # 131072 token-heads
    assert not chunk_driver._overlap(ks(True), q(1, 8), 1, 64) and not chunk_driver._overlap(ks(True), q(2, 2), 2, 64)
    # varlen, starts read on the host: a pass spans its longest sequence, the shorter ones hold the device for
    # part of it. 11 sequences of 512-8192 tokens (mean/longest 0.36), 32 heads: 704 programs a pass would not
    # fit at once, but at 0.36 of the span they do; 16 equal sequences count whole and do not
    mixed = [0]
    for n in (512, 1024, 4096, 8192, 2048, 768, 6144, 1536, 3072, 2560, 2816):
        mixed.append(mixed[-1] + n)
    assert chunk_driver.occupancy(mixed) == pytest.approx(32768 / (11 * 8192))
    assert chunk_driver.occupancy(None) == 1.0 and chunk_driver.occupancy([0, 4096, 8192]) == 1.0
    packed = SimpleNamespace(is_cuda=True, shape=(1, 32768, 32, 64), device=torch.device("cuda", 0))
    assert chunk_driver._overlap(ks(True), packed, 11, 64, mixed)
    assert not chunk_driver._overlap(ks(True), packed, 11, 64)  # starts not read: counted whole
    assert not chunk_driver._overlap(ks(True), packed, 16, 64, list(range(0, 32769, 2048)))
    # tests and benchmarks force it either way
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(overlap=True))
    assert chunk_driver._overlap(ks(False), q(8, 64), 8, 64)
    assert chunk_driver._overlap(ks(True), q(4, 32, cuda=False), 4, 64)  # the CPU: the order, one stream
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(overlap=False))
    assert not chunk_driver._overlap(ks(True), q(4, 32), 4, 64)
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(overlap=None))
    monkeypatch.setattr(chunk_driver, "_capturing", lambda: True)  # inside a CUDA graph capture: one stream
    assert not chunk_driver._overlap(ks(True), q(4, 32), 4, 64)
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(overlap=True))
    assert not chunk_driver._overlap(ks(True), q(4, 32), 4, 64)


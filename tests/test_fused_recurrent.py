"""The fused recurrent op in Triton's interpreter against the float64 reference (fp32 and fp16)."""

from __future__ import annotations


import pytest
import torch

from dplr_gen.runtime import ops
from dplr_gen.testing import rel_err, rwkv7_inputs
from dplr_gen.reference import naive_dplr_delta_rule

from .helpers import render_package

SPEC = """
name: fr_test
targets: [sm_80]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp32, fp16]
    head_dims: [32, [20, 36]]
    varlen: [false, true]
"""


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "fr_test")


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("K, V", [(32, 32), (20, 36)])
def test_forward_matches_reference(pkg, dtype: torch.dtype, bound: float, K: int, V: int) -> None:
    x = rwkv7_inputs(2, 13, 2, K, V, dtype=dtype)
    o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, package=pkg)
    ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel_err(o, ro) <= bound and rel_err(ht, rht) <= bound


def test_varlen_and_no_initial_state(pkg) -> None:
    lens = [1, 5, 16, 3]
    T = sum(lens)
    x = rwkv7_inputs(1, T, 2, 32, dtype=torch.float32, initial_state=False)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, cu_seqlens=cu, package=pkg)
    ro, rht = naive_dplr_delta_rule(**{n: (t.double() if t is not None else None) for n, t in x.items()},
                                    output_final_state=True, cu_seqlens=cu)
    assert ht.shape == (len(lens), 2, 32, 32)
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5


def test_extreme_gates(pkg) -> None:
    x = rwkv7_inputs(1, 9, 2, 32, dtype=torch.float32)
    g = x["gk"]
    g[:, 2] = float("-inf")  # full reset
    g[:, 5] = 0.0  # no decay
    o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, package=pkg)
    ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5


def test_rwkv7_order_and_default_scale(pkg) -> None:
    x = rwkv7_inputs(1, 4, 1, 32, dtype=torch.float32)
    o1, _ = ops.fused_recurrent_rwkv7(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"],
                                      initial_state=x["initial_state"], package=pkg)
    o2, _ = ops.fused_recurrent_dplr_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], scale=1.0,
                                                initial_state=x["initial_state"], package=pkg)
    assert torch.equal(o1, o2)
    o3, _ = ops.fused_recurrent_dplr_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"],
                                                initial_state=x["initial_state"], package=pkg)
    assert rel_err(o3 * 32**0.5, o2) < 1e-5  # scale None means K**-0.5


@pytest.fixture()
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    from dplr_gen.runtime import chunk_driver

    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(poison=True))


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.float16, 3e-3)])
def test_fused_mul_form_is_rwkv7_with_a_and_b_formed(pkg, poisoned: None, dtype: torch.dtype, bound: float) -> None:
    """fused_mul_recurrent_rwkv7(r, w, k, v, kk, a) is the recurrence with a_t = -kk_t, b_t = kk_t * a_t (RWKV-7's
    decoding form, fla-core's signature), formed in the kernel."""
    x = rwkv7_inputs(2, 7, 2, 32, dtype=dtype)
    kk = torch.nn.functional.normalize(torch.randn_like(x["k"], dtype=torch.float32), dim=-1).to(dtype)
    rate = torch.rand_like(x["k"], dtype=torch.float32).to(dtype)
    o, ht = ops.fused_mul_recurrent_rwkv7(x["q"], x["gk"], x["k"], x["v"], kk, rate, initial_state=x["initial_state"],
                                          output_final_state=True, package=pkg)
    ref = {n: t.double() for n, t in x.items()}
    ro, rht = naive_dplr_delta_rule(ref["q"], ref["k"], ref["v"], -kk.double(), kk.double() * rate.double(),
                                    ref["gk"], scale=1.0, initial_state=ref["initial_state"], output_final_state=True)
    assert rel_err(o, ro) <= bound and rel_err(ht, rht) <= bound


def _pool_case(varlen: bool, dtype: torch.dtype = torch.float32) -> dict:
    lens = [3, 1, 4] if varlen else [2, 2, 2]
    x = rwkv7_inputs(1 if varlen else 3, sum(lens) if varlen else 2, 2, 32, dtype=dtype, initial_state=False)
    x.pop("initial_state", None)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if varlen else None
    pool = torch.randn(6, 2, 32, 32)
    return {"x": x, "cu": cu, "lens": lens, "pool": pool}


@pytest.mark.parametrize("varlen", [False, True])
def test_state_pool_reads_and_writes_the_slots_in_place(pkg, poisoned: None, varlen: bool) -> None:
    """ssm_state_indices: sequence i starts from pool[idx[i]] and leaves its final state there, in place; a
    negative index is a padded row (zero initial state, nothing written); every other slot is untouched. Equal to
    a call per sequence with that slot as its initial state."""
    c = _pool_case(varlen)
    x, pool, cu = c["x"], c["pool"], c["cu"]
    idx = torch.tensor([4, -1, 0], dtype=torch.int64)
    before = pool.clone()
    kw = {"cu_seqlens": cu} if varlen else {}
    with torch.no_grad():
        o, ht = ops.fused_recurrent_dplr_delta_rule(**x, initial_state=pool, ssm_state_indices=idx, package=pkg, **kw)
    assert ht is pool
    starts = [0, *torch.tensor(c["lens"]).cumsum(0).tolist()]
    for i, slot in enumerate(idx.tolist()):
        rows = (slice(None), slice(starts[i], starts[i + 1])) if varlen else (slice(i, i + 1),)
        one = {n: t[rows] for n, t in x.items() if t is not None}
        h0 = (before[slot] if slot >= 0 else torch.zeros_like(before[0]))[None]
        ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in one.items()}, initial_state=h0.double(),
                                        output_final_state=True)
        assert rel_err(o[rows], ro) <= 1e-6, i
        if slot >= 0:
            assert rel_err(pool[slot], rht[0]) <= 1e-6, i
    for slot in (1, 2, 3, 5):
        assert torch.equal(pool[slot], before[slot]), slot


def test_state_pool_fused_mul_form(pkg, poisoned: None) -> None:
    c = _pool_case(False)
    x, pool = c["x"], c["pool"]
    kk, rate = torch.randn_like(x["k"]), torch.rand_like(x["k"])
    idx = torch.tensor([2, 5, 0], dtype=torch.int32)
    expect = pool.clone()
    with torch.no_grad():
        o_ref, _ = ops.fused_recurrent_rwkv7(x["q"], x["gk"], x["k"], x["v"], -kk, kk * rate, initial_state=expect,
                                             ssm_state_indices=idx, package=pkg)
        o, _ = ops.fused_mul_recurrent_rwkv7(x["q"], x["gk"], x["k"], x["v"], kk, rate, initial_state=pool,
                                             ssm_state_indices=idx, package=pkg)
    assert rel_err(o, o_ref) <= 1e-6 and rel_err(pool, expect) <= 1e-6


def test_state_pool_bad_arguments_are_refused(pkg) -> None:
    c = _pool_case(False)
    x, pool = c["x"], c["pool"]

    def call(idx: object, p: object = pool, grad: bool = False) -> None:
        with torch.set_grad_enabled(grad):
            xs = {n: t.requires_grad_(grad) if grad else t for n, t in
                  {n: t.clone() for n, t in x.items() if t is not None}.items()}
            ops.fused_recurrent_dplr_delta_rule(**xs, initial_state=p, ssm_state_indices=idx, package=pkg)

    before = pool.clone()
    with pytest.raises(ValueError, match=r"ssm_state_indices holds 6, outside the pool's 6 slots"):
        call(torch.tensor([0, 6, 1]))
    with pytest.raises(ValueError, match=r"gives slot\(s\) \[1\] to more than one sequence"):
        call(torch.tensor([1, -1, 1]))
    with pytest.raises(ValueError, match=r"ssm_state_indices must be \[N\] = \[3\]"):
        call(torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="ssm_state_indices must be an int32 or int64 tensor"):
        call(torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"initial_state must be the state pool \[num_slots, H, K, V\]"):
        call(torch.tensor([0, 1, 2]), pool[:, :1])
    with pytest.raises(ValueError, match="must be a contiguous float32 tensor"):
        call(torch.tensor([0, 1, 2]), pool.half())
    with pytest.raises(ValueError, match="has no gradient: call the op under torch.no_grad"):
        call(torch.tensor([0, 1, 2]), grad=True)
    assert torch.equal(pool, before)  # nothing ran


def test_state_pool_indices_the_host_does_not_read(pkg, poisoned: None) -> None:
    """Indices on the device are not read by the host (no sync): a slot past the pool gives that sequence NaN
    outputs and writes nothing; the other sequences are unaffected. (The kernel's behaviour, driven directly,
    as the op passes device indices to it.)"""
    from dplr_gen.runtime import fused_recurrent_driver as fd

    c = _pool_case(False)
    x, pool = c["x"], c["pool"]
    before = pool.clone()
    variant = ops.variant_for(pkg, "fused_recurrent", x["q"], x["v"], x["gk"])
    ks, var = ops._kernels(pkg.dir_str, variant, x["q"].device)
    idx = torch.tensor([0, 9, 3], dtype=torch.int32)
    o, _ = fd.fused_recurrent_dplr_fwd(ks, var, x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], 1.0, pool, None,
                                       idx)
    assert torch.isnan(o[1]).all() and torch.isfinite(o[0]).all() and torch.isfinite(o[2]).all()
    assert not torch.equal(pool[0], before[0]) and not torch.equal(pool[3], before[3])
    for slot in (1, 2, 4, 5):
        assert torch.equal(pool[slot], before[slot]), slot


GATE_SPEC = """
name: fr_gate
targets: [sm_90]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp16]
    head_dims: [32]
    varlen: [false]
  - ops: [fused_recurrent]
    dtypes: [fp16]
    head_dims: [32]
    varlen: [false]
    gate_dtype: same
  # the gradient through a step reading gk in fp16 takes the any-gate chunk backward of that gate dtype
  - ops: [chunk]
    dtypes: [fp16]
    head_dims: [32]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [null]
    gate_dtype: same
"""


def test_step_reading_the_gate_in_its_dtype(tmp_path, poisoned: None) -> None:
    """gk arriving in fp16 is read as it is (no conversion), with the fp32-gate variant's results bit for bit
    (fp16 -> fp32 is exact); its gradient, through the chunk backward of the same gate dtype, comes back in
    fp16 and matches the float64 reference."""
    package = render_package(tmp_path, GATE_SPEC, "fr_gate")
    x = {n: t.requires_grad_(True) for n, t in rwkv7_inputs(2, 21, 2, 32, dtype=torch.float16, seed=3).items()}
    assert ops.variant_for(package, "fused_recurrent", x["q"], x["v"], x["gk"]).endswith("gfp16_sfp32")
    o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, package=package)
    x32 = {n: t.detach().clone() for n, t in x.items()}
    x32["gk"] = x32["gk"].float()
    assert ops.variant_for(package, "fused_recurrent", x32["q"], x32["v"], x32["gk"]).endswith("gfp32_sfp32")
    o32, ht32 = ops.fused_recurrent_dplr_delta_rule(**x32, output_final_state=True, package=package)
    assert torch.equal(o, o32) and torch.equal(ht, ht32)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = torch.autograd.grad((o, ht), list(x.values()), (do, dht))
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    ro, rht = naive_dplr_delta_rule(**ref, output_final_state=True)
    want = torch.autograd.grad((ro, rht), list(ref.values()), (do.double(), dht.double()))
    for (n, t), g, w in zip(x.items(), grads, want):
        assert g.dtype == t.dtype and rel_err(g, w) <= 5e-3, (n, rel_err(g, w))


@pytest.fixture()
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the fused recurrent kernels launched (in order)."""
    from dplr_gen.runtime import fused_recurrent_driver as fd

    names: list[str] = []
    real = fd._launch

    def spy(ks, name, grid, args):  # type: ignore[no-untyped-def]
        names.append(name)
        return real(ks, name, grid, args)

    monkeypatch.setattr(fd, "_launch", spy)
    return names


STEP, LOOP = "fused_recurrent_dplr_step_kernel", "fused_recurrent_dplr_fwd_kernel"


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.float16, 3e-3)])
@pytest.mark.parametrize("K, V", [(32, 32), (20, 36)])
def test_decode_step_takes_the_step_kernel(pkg, poisoned: None, launched: list[str], dtype: torch.dtype,
                                           bound: float, K: int, V: int) -> None:
    """T = 1 (a decode step): the kernel without the loop over time, odd head dims (masked tiles) included, equal to
    the reference; T = 2 keeps the loop."""
    for T, kernel in ((1, STEP), (2, LOOP)):
        x = rwkv7_inputs(3, T, 2, K, V, dtype=dtype)
        launched.clear()
        with torch.no_grad():
            o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, package=pkg)
        assert launched == [kernel]
        ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True)
        assert rel_err(o, ro) <= bound and rel_err(ht, rht) <= bound, T


def test_decode_step_varlen_one_token_each(pkg, poisoned: None, launched: list[str]) -> None:
    """Varlen with as many sequences as tokens (starts read on the host, none empty: one token each) takes the step
    kernel, equal to the reference; a varlen call with a longer sequence keeps the loop."""
    for lens, kernel in (([1, 1, 1, 1], STEP), ([1, 2, 1], LOOP)):
        x = rwkv7_inputs(1, sum(lens), 2, 32, dtype=torch.float32)
        x["initial_state"] = torch.randn(len(lens), 2, 32, 32)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        launched.clear()
        with torch.no_grad():
            o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, cu_seqlens=cu, package=pkg)
        assert launched == [kernel], lens
        ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True,
                                        cu_seqlens=cu)
        assert rel_err(o, ro) <= 1e-6 and rel_err(ht, rht) <= 1e-6, lens


def test_decode_step_state_pool_and_mul_form(pkg, poisoned: None, launched: list[str]) -> None:
    """The step kernel with a state pool (RWKV-7's mul form): slot i read and written in place, a negative slot a
    padded row, a slot past the pool (indices on the device, not read by the host) NaN outputs and no write."""
    from dplr_gen.runtime import fused_recurrent_driver as fd

    x = rwkv7_inputs(4, 1, 2, 32, dtype=torch.float32, initial_state=False)
    kk = torch.nn.functional.normalize(torch.randn_like(x["k"]), dim=-1)
    rate = torch.rand_like(x["k"])
    pool = torch.randn(6, 2, 32, 32)
    before = pool.clone()
    variant = ops.variant_for(pkg, "fused_recurrent", x["q"], x["v"], x["gk"])
    ks, var = ops._kernels(pkg.dir_str, variant, x["q"].device)
    idx = torch.tensor([4, -1, 9, 0], dtype=torch.int32)
    o, _ = fd.fused_recurrent_dplr_fwd(ks, var, x["q"], x["k"], x["v"], kk, rate, x["gk"], 1.0, pool, None, idx,
                                       mul_ab=True)
    assert launched == [STEP]
    assert torch.isnan(o[2]).all()
    for i, slot in enumerate(idx.tolist()):
        if slot >= 6:
            continue
        h0 = (before[slot] if slot >= 0 else torch.zeros_like(before[0]))[None].double()
        one = {n: t[i:i + 1].double() for n, t in x.items() if t is not None}
        ro, rht = naive_dplr_delta_rule(one["q"], one["k"], one["v"], -kk[i:i + 1].double(),
                                        (kk * rate)[i:i + 1].double(), one["gk"], scale=1.0, initial_state=h0,
                                        output_final_state=True)
        assert rel_err(o[i:i + 1], ro) <= 1e-6, i
        if slot >= 0:
            assert rel_err(pool[slot], rht[0]) <= 1e-6, i
    for slot in (1, 2, 3, 5):
        assert torch.equal(pool[slot], before[slot]), slot


def test_decode_step_varlen_pool(pkg, poisoned: None, launched: list[str]) -> None:
    """A serving step: varlen with one token each and a state pool (host indices, a padded row) takes the step
    kernel and equals a dense call per sequence from its slot; the slots not named are untouched."""
    x = rwkv7_inputs(1, 3, 2, 32, dtype=torch.float32, initial_state=False)
    x.pop("initial_state", None)
    cu = torch.tensor([0, 1, 2, 3])
    pool = torch.randn(5, 2, 32, 32)
    before = pool.clone()
    idx = torch.tensor([3, -1, 1])
    with torch.no_grad():
        o, _ = ops.fused_recurrent_dplr_delta_rule(**x, initial_state=pool, ssm_state_indices=idx, cu_seqlens=cu,
                                                   package=pkg)
    assert launched == [STEP]
    for i, slot in enumerate(idx.tolist()):
        one = {n: t[:, i:i + 1].double() for n, t in x.items()}
        h0 = (before[slot] if slot >= 0 else torch.zeros_like(before[0]))[None].double()
        ro, rht = naive_dplr_delta_rule(**one, initial_state=h0, output_final_state=True)
        assert rel_err(o[:, i:i + 1], ro) <= 1e-6, i
        if slot >= 0:
            assert rel_err(pool[slot], rht[0]) <= 1e-6, i
    for slot in (0, 2, 4):
        assert torch.equal(pool[slot], before[slot]), slot


def test_decode_step_delta_rule_inputs_and_extreme_gates(pkg, poisoned: None, launched: list[str]) -> None:
    """The step kernel on delta-rule inputs (b = -a) with full resets (gk = -inf) and no-decay channels (gk = 0) in
    one step: finite, equal to the reference."""
    x = rwkv7_inputs(4, 1, 2, 20, 36, dtype=torch.float32)
    x["b"] = -x["a"]
    x["gk"][..., :5] = float("-inf")
    x["gk"][..., 5:9] = 0.0
    with torch.no_grad():
        o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, package=pkg)
    assert launched == [STEP]
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    assert rel_err(o, ro) <= 1e-6 and rel_err(ht, rht) <= 1e-6

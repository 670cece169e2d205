"""Variants generated on demand (dplr_gen.runtime.ondemand): calls no built variant covers (other K, V, K != V, dense and
varlen, fp32 and fp16) run in the interpreter against the float64 reference, forward and every gradient, on
NaN-poisoned buffers; one log line names each generated variant and the spec entry that ships it;
DPLR_GEN_NO_JIT=1 refuses with that entry; bf16 on the interpreter computes right; real compiles of odd dims for
sm_80 / sm_90 land in the cache, where a second process finds them and compiles nothing."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dplr_gen.toolchain import cache
from dplr_gen.runtime import chunk_driver, ondemand, ops
from dplr_gen.toolchain.compile import CompileOutcome
from dplr_gen.spec.models import VariantAxes, load_spec
from dplr_gen.testing import rel_err, rwkv7_inputs
from dplr_gen.plan.variant import Variant
from dplr_gen.plan.variants import _axes_product

from .helpers import fwd_bwd_errors, render_package

# built: K = V = 64 only, so every dim below is generated on demand
SPEC = """
name: ondemand_test
targets: [sm_80]
variants:
  - ops: [chunk]
    dtypes: [fp32, fp16]
    head_dims: [64]
    chunk_sizes: [16]
    varlen: [false, true]
    gate_bounds: [null, -0.61]
  - ops: [fused_recurrent]
    dtypes: [fp32, fp16]
    head_dims: [64]
    varlen: [false, true]
"""
BOUND = {torch.float32: 2e-5, torch.float16: 3e-3}
LENS = [5, 17]  # varlen: one sequence inside a chunk, one across two


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "ondemand_test")


@pytest.fixture(autouse=True)
def poison(monkeypatch: pytest.MonkeyPatch) -> None:
    # every buffer NaN before the kernels write it
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(poison=True))
    monkeypatch.delenv("DPLR_GEN_NO_JIT", raising=False)


def inputs(K: int, V: int, dtype: torch.dtype, varlen: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, keywords): B = 2, T = 19, H = 2 dense; two sequences of LENS tokens varlen."""
    if not varlen:
        return rwkv7_inputs(2, 19, 2, K, V, dtype=dtype), {}
    x = rwkv7_inputs(1, sum(LENS), 2, K, V, dtype=dtype, initial_state=False)
    x["initial_state"] = torch.randn(len(LENS), 2, K, V)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return x, {"cu_seqlens": cu, "cu_seqlens_cpu": cu}


def check(pkg, op: Any, op_name: str, K: int, V: int, dtype: torch.dtype, varlen: bool, **kw: Any) -> None:
    x, extra = inputs(K, V, dtype, varlen)
    if op_name == "fused_recurrent":
        extra.pop("cu_seqlens_cpu", None)
    name = ops._select(str(pkg.dir), op_name, dtype, K, V, varlen, lower_bound=kw.get("lower_bound"),
                       gate_dtype=dtype)
    var = pkg.variants[name]
    assert not pkg.built(name) and (var.K, var.V, var.varlen, var.op) == (K, V, varlen, op_name)
    errs = fwd_bwd_errors(lambda **a: op(**a, package=pkg), x, **extra, **kw)
    assert set(errs) == {"o", "ht", "q", "k", "v", "a", "b", "gk", "initial_state"}
    bad = {n: e for n, e in errs.items() if not e <= BOUND[dtype]}
    assert not bad, (name, bad)


DIMS = [(16, 16), (32, 32), (48, 48), (60, 60), (100, 100), (32, 64), (64, 128), (100, 60)]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("K, V", DIMS, ids=[f"k{k}v{v}" for k, v in DIMS])
def test_chunk_on_demand_matches_reference(pkg, K: int, V: int, dtype: torch.dtype, varlen: bool) -> None:
    # the bounded variant (lower_bound) for half the cases: both gate forms get generated
    bound = -0.61 if (K + V + varlen) % 2 else None
    check(pkg, ops.chunk_dplr_delta_rule, "chunk", K, V, dtype, varlen, lower_bound=bound)


@pytest.mark.parametrize("K, V, dtype, varlen", [(60, 60, torch.float32, False), (100, 60, torch.float16, True),
                                                 (24, 40, torch.float32, True), (200, 17, torch.float16, False)])
def test_fused_recurrent_on_demand_matches_reference(pkg, K: int, V: int, dtype: torch.dtype, varlen: bool) -> None:
    """The fused recurrent op at odd dims (its backward: an on-demand chunk variant of the same dims)."""
    check(pkg, ops.fused_recurrent_dplr_delta_rule, "fused_recurrent", K, V, dtype, varlen)


def test_rwkv7_ops_on_demand(pkg) -> None:
    x = rwkv7_inputs(1, 21, 2, 60, 36, dtype=torch.float32)
    args = (x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"])
    ref = ops.chunk_dplr_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], scale=1.0,
                                    initial_state=x["initial_state"], output_final_state=True, package=pkg)
    for op in (ops.chunk_rwkv7, ops.fused_recurrent_rwkv7):
        o, ht = op(*args, initial_state=x["initial_state"], output_final_state=True, package=pkg)
        assert rel_err(o, ref[0]) <= 1e-5 and rel_err(ht, ref[1]) <= 1e-5, op.__name__


def test_one_log_line_names_the_variant_and_its_spec_entry(pkg, caplog: pytest.LogCaptureFixture) -> None:
    """One record per generated variant (not per call), naming it and a spec entry that, put in a spec,
    builds exactly that variant."""
    x = rwkv7_inputs(1, 9, 1, 36, 44, dtype=torch.float16)
    with caplog.at_level(logging.INFO, logger="dplr_gen"):
        for _ in range(2):
            ops.chunk_dplr_delta_rule(**x, package=pkg, lower_bound=-0.61)
    records = [r for r in caplog.records if r.name == "dplr_gen"]
    assert len(records) == 1, [r.getMessage() for r in records]
    msg = records[0].getMessage()
    name = ops._select(str(pkg.dir), "chunk", torch.float16, 36, 44, False, lower_bound=-0.61,
                       gate_dtype=torch.float16)
    assert name in msg and "on demand" in msg
    entry = msg[msg.index("- {"):]
    group = yaml.safe_load(entry)
    assert isinstance(group, list) and len(group) == 1
    variants = _axes_product(VariantAxes(**group[0]))
    assert [v.name for v in variants] == [name]


@pytest.mark.parametrize("v", [
    Variant("chunk", "bf16", "bf16", 60, 100, 16, True, -0.61, "fp32", None),
    Variant("chunk", "fp32", "fp32", 48, 48, 32, False, None, "fp32", "tf32"),
    Variant("fused_recurrent", "fp16", "fp32", 100, 100, None, False, None, "fp32", None),
], ids=lambda v: v.name)
def test_spec_entry_builds_exactly_the_variant(v: Variant) -> None:
    (group,) = yaml.safe_load(ondemand.spec_entry(v))
    assert [x.name for x in _axes_product(VariantAxes(**group))] == [v.name]


def test_no_jit_names_the_entry_and_the_nearest_built(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_NO_JIT", "1")
    x = rwkv7_inputs(1, 8, 2, 52, 20, dtype=torch.float16)
    for _ in range(2):  # the refusal is not remembered as an answer either
        with pytest.raises(ValueError) as e:
            ops.chunk_dplr_delta_rule(**x, package=pkg)
        msg = str(e.value)
        assert "DPLR_GEN_NO_JIT=1" in msg and "K=52 V=20" in msg
        assert "- {ops: [chunk], dtypes: [fp16], head_dims: [[52, 20]]" in msg
        assert f"dplr-gen build {pkg.spec_file}" in msg and f"`dplr-gen list {pkg.spec_file}`" in msg
        near = msg.split("Nearest built: ")[1].split(" (all")[0].split(", ")
        assert len(near) == 4 and all(n.startswith("chunk_fp16_k64") for n in near)
    assert not any(v.K == 52 for v in pkg.variants.values())


@pytest.mark.parametrize("which, dims, valid", [("q", (8, 8), "16 to 256"), ("v", (64, 300), "16 to 256")])
def test_head_dims_out_of_range_are_named(pkg, which: str, dims: tuple[int, int], valid: str) -> None:
    x = rwkv7_inputs(1, 8, 2, *dims, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"{which} has head dim .* = {dims[0] if which == 'q' else dims[1]}.*{valid}"):
        ops.chunk_dplr_delta_rule(**x, package=pkg)


def test_fla_chunk_size_and_safe_gate_are_accepted(pkg) -> None:
    """chunk_size picks among built chunks only; one with no built variant of that chunk computes the same
    function (the package builds chunk 16 only), at a built and at an on-demand head dim."""
    for K, V in ((64, 64), (40, 40)):
        x = rwkv7_inputs(1, 37, 2, K, V, dtype=torch.float32)
        base = ops.chunk_dplr_delta_rule(**x, package=pkg, output_final_state=True)
        for cs in (16, 32, 64):
            o, ht = ops.chunk_dplr_delta_rule(**x, package=pkg, output_final_state=True, chunk_size=cs, safe_gate=True)
            assert rel_err(o, base[0]) <= 1e-5 and rel_err(ht, base[1]) <= 1e-5, (K, cs)


@pytest.mark.parametrize("op", [ops.chunk_dplr_delta_rule, ops.fused_recurrent_dplr_delta_rule])
def test_bf16_on_the_interpreter_is_computed_in_fp32(pkg, op: Any) -> None:
    """bf16 CPU calls run on float32 copies (the interpreter's bf16 dots are wrong): output in bf16, gradients
    in the inputs' dtypes, all within bf16 rounding of the float64 reference."""
    x = rwkv7_inputs(1, 40, 2, 64, dtype=torch.bfloat16)
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, ht = op(**xs, output_final_state=True, package=pkg)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    from .helpers import reference_with_grads

    ro, rht, rg = reference_with_grads(x, None, None, do, dht)
    assert rel_err(o, ro) <= 8e-3 and rel_err(ht, rht) <= 8e-3
    for n, t in xs.items():
        assert t.grad.dtype == x[n].dtype and rel_err(t.grad, rg[n]) <= 1.5e-2, n


def test_dispatcher_generates_from_the_repository_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """dplr_gen.<op> on CPU tensors: the built spec's package, a dim it does not build, generated from
    specs/<spec>.yaml."""
    import dplr_gen

    monkeypatch.setenv("DPLR_GEN_SPEC", "ampere")
    x = rwkv7_inputs(1, 10, 1, 24, dtype=torch.float32)
    errs = fwd_bwd_errors(dplr_gen.chunk_dplr_delta_rule, x)
    assert max(errs.values()) <= 2e-5, errs


# ----------------------------------------------------------------------------------------------------------
# real compiles (no GPU needed) and the cache


PREPARE = (
    "import json, sys; from dplr_gen.runtime import ondemand; from dplr_gen.spec.models import load_spec; "
    "from dplr_gen.plan.variant import Variant; "
    "p = ondemand.prepare(load_spec(sys.argv[1]), Variant(**json.loads(sys.argv[2])), sys.argv[3]); "
    "print(json.dumps({'stats': dict(ondemand.STATS), 'compiled': p.compiled, 'kernels': p.kernels}))"
)


def _start_prepare(spec_path: Path, v: Variant, target: str, cache_dir: Path) -> subprocess.Popen[str]:
    """ondemand.prepare in a fresh process (no interpreter) with its own cache folder."""
    env = {**os.environ, "DPLR_GEN_CACHE_DIR": str(cache_dir)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, "-c", PREPARE, str(spec_path), json.dumps(v.params()), target],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _prepare_in_subprocess(spec_path: Path, v: Variant, target: str, cache_dir: Path) -> dict[str, Any]:
    return _result(_start_prepare(spec_path, v, target, cache_dir))


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_odd_dims_compile_and_a_second_process_compiles_nothing(pkg, tmp_path: Path, target: str) -> None:
    """K = 60, V = 100 compiled for a real target (every kernel within the arch's shared memory, no MMA->MMA
    conversion), stored in the cache; a second process renders the same source, finds the record and its
    entries, and starts no compile."""
    spec_path = pkg.dir.parent / "ondemand_test.yaml"
    v = Variant("chunk", "fp16", "fp32", 60, 100, 16, False, None, "fp32", None)
    first = _prepare_in_subprocess(spec_path, v, target, tmp_path)
    assert first["compiled"] == len(first["kernels"]) >= 6
    assert 1 <= first["stats"]["compile_jobs"] <= min(ondemand.cpus(), len(first["kernels"]))
    tv = ondemand._triton_version()
    for name, key in first["kernels"]:
        meta = cache.read_entry(key, tv, tmp_path)
        assert meta is not None and meta["target"] == target and meta["kernel"] == name
    second = _prepare_in_subprocess(spec_path, v, target, tmp_path)
    assert second["compiled"] == 0 and second["stats"] == {"from_cache": 1}
    assert second["kernels"] == first["kernels"]
    sources = list((tmp_path / f"triton-{tv}" / "ondemand" / "ondemand_test").glob("*.py"))
    assert len(sources) == 1 and "Do not edit" in sources[0].read_text().splitlines()[0]


def test_two_processes_generating_at_once_compile_once(pkg, tmp_path: Path) -> None:
    spec_path = pkg.dir.parent / "ondemand_test.yaml"
    v = Variant("fused_recurrent", "fp16", "fp32", 20, 28, None, False, None, "fp32", None)
    procs = [_start_prepare(spec_path, v, "sm_80", tmp_path) for _ in range(2)]
    results = [_result(p) for p in procs]
    assert sorted(r["compiled"] for r in results) == [0, len(results[0]["kernels"])]
    assert results[0]["kernels"] == results[1]["kernels"]


def test_over_shared_memory_shrinks_the_tiles(pkg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel over the target's shared memory is compiled again with its stage's V tile halved (then fewer
    stages) until it fits; the record keeps the tiling that fit, so a later call compiles nothing. (Fake
    compiler: a kernel 'fits' at V tiles of 16 and one pipeline stage.)"""
    from dplr_gen.toolchain.compile import import_source

    compiled: list[str] = []

    def fake(job: Any) -> CompileOutcome:
        m = import_source(job.source, f"fake_{Path(job.source).stem}")
        out = CompileOutcome(job.unit, job.target, True)
        for name in job.kernels:
            bv, stages = m.CONSTEXPRS[name].get("BV", 16), m.LAUNCH[name]["num_stages"]
            if bv > 16 or stages > 1:
                out.ok, out.error = False, f"kernel {name}: too much"
                out.failed.append(name)
                out.over_smem.append(name)
                continue
            key = cache.cache_key(source=job.source_hash, kernel=name)
            with cache.locked(key, job.triton_version, Path(job.cache_root)):
                cache.write_entry(key, job.triton_version, {}, {"kernel": name, "key": key}, Path(job.cache_root))
            out.kernels.append({"kernel": name, "key": key})
            out.compiled.append(name)
            compiled.append(name)
        return out

    monkeypatch.setattr(ondemand, "run_in_subprocess", fake)
    spec = load_spec(pkg.dir.parent / "ondemand_test.yaml")
    v = Variant("chunk", "fp16", "fp32", 40, 72, 16, False, None, "fp32", None)
    p = ondemand.prepare(spec, v, "sm_80", root=tmp_path)
    assert p.compiled == len(p.kernels) == len(set(compiled)) and p.shrunk
    assert any("block_v" in s for s in p.shrunk) and any("num_stages" in s for s in p.shrunk)
    text = p.source.read_text()
    assert '"BV": 16' in text and '"num_stages": 2' not in text
    compiled.clear()
    again = ondemand.prepare(spec, v, "sm_80", root=tmp_path)
    assert compiled == [] and again.kernels == p.kernels and again.source == p.source and again.shrunk == p.shrunk


def test_kernels_are_spread_over_the_cpus_by_cost() -> None:
    names = ["chunk_dplr_prep_kernel", "chunk_dplr_bwd_kernel", "chunk_dplr_fwd_kernel", "chunk_dplr_prep_bwd_kernel",
             "chunk_dplr_bwd_dh_kernel", "chunk_dplr_fwd_h_kernel"]
    assert ondemand.spread(names, 1) == [sorted(names, key=lambda n: -ondemand.HEAVY_KERNELS.get(n, 1.0))]
    two = ondemand.spread(names, 2)
    assert sorted(sum(two, [])) == sorted(names) and [len(g) for g in two] == [3, 3]
    assert {"chunk_dplr_bwd_kernel", "chunk_dplr_prep_bwd_kernel"} not in [set(g) & set(ondemand.HEAVY_KERNELS) for g in two]
    assert sorted(map(len, ondemand.spread(names, 16))) == [1] * 6


def test_other_compile_failures_are_errors(pkg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ondemand, "run_in_subprocess",
                        lambda job: CompileOutcome(job.unit, job.target, False, error="the compiler aborted"))
    spec = load_spec(pkg.dir.parent / "ondemand_test.yaml")
    v = Variant("fused_recurrent", "fp16", "fp32", 40, 40, None, False, None, "fp32", None)
    with pytest.raises(RuntimeError, match="generating variant fused_recurrent_fp16_k40.* sm_80 failed: the compiler"):
        ondemand.prepare(spec, v, "sm_80", root=tmp_path)


def test_segments_dropped_for_variants_generated_from_the_hopper_spec(tmp_path: Path) -> None:
    """hopper.yaml tunes its dense bf16 variants' small-grid state passes over 8 segments; those kernels do not
    build for sm_90 at K = 16 (a conversion between MMA layouts) or K = 256 (262 KB of shared memory), so a
    variant generated on demand takes no segments, and K = 16 compiles."""
    spec_path = Path(__file__).resolve().parent.parent / "specs" / "hopper.yaml"
    spec = load_spec(spec_path)
    for K, bound in ((16, -0.61), (256, None), (64, None)):
        u = ondemand.unit_of(spec, Variant("chunk", "bf16", "bf16", K, K, 16, False, bound, "fp32", None), "sm_90")
        assert all(not (k.segments or 0) for k in u.tune.values()), (K, u.tune)
    v = Variant("chunk", "bf16", "bf16", 16, 16, 16, False, -0.61, "fp32", None)
    res = _prepare_in_subprocess(spec_path, v, "sm_90", tmp_path)
    assert res["compiled"] == len(res["kernels"]) >= 6


def test_a_generated_variant_is_said_once_per_process(tmp_path: Path) -> None:
    """Without any logging set up the user sees a generated variant: an OnDemandVariantWarning naming it and the
    spec entry that ships it, once per process (a second package loading the same variant says nothing)."""
    import warnings

    x = rwkv7_inputs(1, 5, 1, 24, 40, dtype=torch.float32)
    name = "fused_recurrent_fp32_k24_v40_dense_gany_gfp32_sfp32_ieee"
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    with pytest.warns(ondemand.OnDemandVariantWarning) as caught:
        ops.fused_recurrent_dplr_delta_rule(**x, package=render_package(tmp_path / "one", SPEC, "ondemand_test"))
    said = [str(w.message) for w in caught if w.category is ondemand.OnDemandVariantWarning]
    assert len(said) == 1 and name in said[0] and "- {ops: [fused_recurrent]" in said[0], said
    with warnings.catch_warnings():
        warnings.simplefilter("error", ondemand.OnDemandVariantWarning)
        ops.fused_recurrent_dplr_delta_rule(**x, package=render_package(tmp_path / "two", SPEC, "ondemand_test"))

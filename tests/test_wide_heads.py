"""Head dims above 128 (the spec allows K, V up to 256, non powers of two, K != V): ahead-of-time compiles that
must fit the shared memory of the tightest archs, and interpreter numerics against the float64 reference.

Chunk kernels at K > 128 default to 16-wide V tiles, and their bounded-gate backward recomputes the gate-factored
tiles after its V loop (dplr_gen/plan/chunk_plan.py: the default V tile, refactor_after_v_loop); the fused recurrent kernel defaults to 32-wide V tiles there.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from dplr_gen.toolchain import build as b
from dplr_gen.runtime import chunk_driver, ops
from dplr_gen.spec.arch import get_arch
from dplr_gen.reference import naive_dplr_delta_rule
from dplr_gen.testing import rel_err, rwkv7_inputs

from .helpers import fwd_bwd_errors, render_package

# sm_86: 99 KB of shared memory per block (as sm_89, sm_120); sm_90: wgmma and the no_mma_chaining templates
AOT = """
name: wide_aot
targets: [sm_86, sm_90]
variants:
  - ops: [chunk]
    dtypes: [bf16]
    head_dims: [256]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [-0.61]
  - ops: [fused_recurrent]
    dtypes: [bf16]
    head_dims: [256]
    varlen: [false]
tuning:
  chunk.bwd: {num_stages: 1}
"""


def test_k256_bf16_builds_and_fits_99kb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))  # a real compile, not a cache hit
    spec = tmp_path / "wide_aot.yaml"
    spec.write_text(AOT)
    report = b.build(spec, jobs=2, out_root=tmp_path / "gen")
    assert not report.failures, [f.error for f in report.failures]
    assert not report.refused, report.refused
    shared = {(o.target, k["kernel"]): k["shared"] for o in report.outcomes for k in o.kernels}
    assert len(shared) == 2 * 8  # per target: the chunk op's 6 kernels and the fused recurrent two (loop, step)
    for (target, kernel), used in shared.items():
        assert used <= get_arch(target).smem_per_block, (target, kernel, used)
    print({f"{t}/{k}": n for (t, k), n in sorted(shared.items())})


NUMERICS = """
name: wide_numerics
targets: [sm_80]
variants:
  - ops: [chunk]
    dtypes: [fp32]
    head_dims: [256, [192, 160]]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [null, -0.61]
  - ops: [fused_recurrent]
    dtypes: [fp32]
    head_dims: [256, [192, 160]]
    varlen: [false]
"""
SHAPES = [(256, 256), (192, 160)]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), NUMERICS, "wide_numerics")


@pytest.mark.parametrize("lower_bound", [-0.61, None], ids=["bounded", "any_gate"])
@pytest.mark.parametrize("K, V", SHAPES)
def test_chunk_forward_backward(pkg, monkeypatch: pytest.MonkeyPatch, K: int, V: int,
                                lower_bound: float | None) -> None:
    # every buffer NaN before the kernels write it
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(poison=True))
    name = ops._select(str(pkg.dir), "chunk", torch.float32, K, V, False, None, lower_bound)
    assert pkg.variants[name].gate_bound == lower_bound
    src = (pkg.dir / pkg.index["variants"][name]["targets"]["sm_80"]["source"]).read_text()
    assert re.findall(r'"BV": (\d+)', src) == ["16"] * 4  # several V blocks in every kernel with a V tile
    # the bounded token pass loads its inputs only after its V loop (no [C, K] input tile kept through it);
    # the exact one before it
    token_pass = src[src.index("def chunk_dplr_bwd_kernel("):]
    after = token_pass.index("_load_inputs(") > token_pass.index("for i_v in range(")
    assert token_pass.count("_load_inputs(") == 1 and after == (lower_bound is not None)
    # T not a multiple of the chunk; one head for the exact (any gate) path, whose row loops are slow here
    x = rwkv7_inputs(1, 37, 1 if lower_bound is None else 2, K, V, dtype=torch.float32)
    errs = fwd_bwd_errors(functools.partial(ops.chunk_dplr_delta_rule, package=pkg), x, lower_bound=lower_bound)
    print({n: f"{e:.1e}" for n, e in errs.items()})
    assert len(errs) == 9 and all(e <= 1e-5 for e in errs.values()), errs


@pytest.mark.parametrize("K, V", SHAPES)
def test_fused_recurrent_forward(pkg, K: int, V: int) -> None:
    name = ops._select(str(pkg.dir), "fused_recurrent", torch.float32, K, V, False)
    src = (pkg.dir / pkg.index["variants"][name]["targets"]["sm_80"]["source"]).read_text()
    assert re.findall(r'"BV": (\d+)', src) == ["32", "32"]  # 8192-element state tiles: 32 wide at K > 128
    x = rwkv7_inputs(1, 37, 2, K, V, dtype=torch.float32)
    o, ht = ops.fused_recurrent_dplr_delta_rule(**x, output_final_state=True, package=pkg)
    ro, rht = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5

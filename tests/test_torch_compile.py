"""The ops are torch.library custom ops: torch.compile(fullgraph=True) traces them without a graph break."""

from __future__ import annotations

import pytest
import torch

from dplr_gen.runtime import ops
from dplr_gen.testing import rel_err, rwkv7_inputs

from .helpers import render_package

SPEC = """
name: compile_test
targets: [sm_80]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp32]
    head_dims: [32]
    varlen: [false, true]
"""


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "compile_test")


@pytest.mark.parametrize("varlen", [False, True])
def test_fullgraph_matches_eager(pkg, varlen: bool) -> None:
    torch._dynamo.reset()
    x = rwkv7_inputs(1, 6, 2, 32, dtype=torch.float32)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32) if varlen else None
    if varlen:
        x["initial_state"] = torch.randn(2, 2, 32, 32)

    def f(q, k, v, a, b, gk, h0):
        o, ht = ops.fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, initial_state=h0, output_final_state=True,
                                                    cu_seqlens=cu, package=pkg)
        return o * 2, ht

    args = [x[n] for n in ("q", "k", "v", "a", "b", "gk", "initial_state")]
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert rel_err(compiled[0], eager[0]) < 1e-6 and rel_err(compiled[1], eager[1]) < 1e-6



@pytest.mark.slow
@pytest.mark.parametrize("entry", ["dplr_gen", "generated"])
def test_top_level_and_package_ops_compile_fullgraph(entry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dplr_gen.chunk_rwkv7`` (the dispatcher, which lists generated/ to find its package) and
    ``generated.<spec>.chunk_rwkv7`` both trace without a graph break and equal eager, gradients included."""
    import dplr_gen
    import generated.ampere

    monkeypatch.delenv("DPLR_GEN_SPEC", raising=False)

    def step(r, w, k, v, a, b, h0):
        op = dplr_gen.chunk_rwkv7 if entry == "dplr_gen" else generated.ampere.chunk_rwkv7
        o, ht = op(r, w, k, v, a, b, initial_state=h0, output_final_state=True, lower_bound=-0.61)
        return o * 2, ht

    torch._dynamo.reset()
    x = rwkv7_inputs(1, 20, 1, 64, dtype=torch.float32, seed=7)
    inputs = [x[n] for n in ("q", "gk", "k", "v", "a", "b", "initial_state")]
    do, dht = torch.randn(1, 20, 1, 64), torch.randn(1, 1, 64, 64)
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        o, ht = fn(*xs)
        results.append([o, ht, *torch.autograd.grad((o, ht), xs, (do, dht))])
    assert all(rel_err(c, e) < 1e-6 for c, e in zip(results[1], results[0]))

"""The ops are torch.library custom ops: torch.compile(fullgraph=True) traces them without a graph break."""

from __future__ import annotations

import pytest
import torch

from dplr_gen import ops
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

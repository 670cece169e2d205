"""The fused recurrent op in Triton's interpreter against the float64 reference (fp32 and fp16)."""

from __future__ import annotations

from pathlib import Path

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

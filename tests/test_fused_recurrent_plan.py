"""The fused recurrent kernel plan (dplr_gen/plan/fused_recurrent_plan.py): its tiles are what the template renders
and the driver reads; the kernel's def and SIGNATURES take the declared arguments."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from dplr_gen.plan.fused_recurrent_plan import FWD, STEP, arguments, fused_recurrent_plan, plan_fused_recurrent
from dplr_gen.render.render import launch

from .helpers import rendered_module, spec_units


@pytest.mark.parametrize("spec", ["hopper.yaml", "ada.yaml", "ampere.yaml", "blackwell.yaml"])
def test_rendered_module_carries_the_plan(spec: str, tmp_path: Path) -> None:
    """Every fused unit's CONSTEXPRS and LAUNCH hold the plan's tiles and knobs, and its kernel's def and SIGNATURES
    name the declared arguments, in order, with the declared types."""
    units = [u for u in spec_units(spec) if u.variant.op == "fused_recurrent"]
    assert units
    seen = set()
    for u in units:
        plan, ns = fused_recurrent_plan(u), rendered_module(u, tmp_path)
        v = u.variant
        assert list(ns["SIGNATURES"]) == [FWD, STEP], u.name
        for name, bv, knobs in ((FWD, plan.block_v, plan.knobs_fwd), (STEP, plan.block_v_step, plan.knobs_step)):
            assert ns["CONSTEXPRS"][name] == {"K": v.K, "V": v.V, "BK": plan.block_k, "BV": bv}, u.name
            assert ns["LAUNCH"][name] == ast.literal_eval(launch(knobs)), u.name
            declared = arguments(name, plan)
            assert list(ns["SIGNATURES"][name].items()) == list(declared.items()), u.name
            assert list(ns[name].arg_names) == [*declared, "K", "V", "BK", "BV"], u.name
            assert declared["q"] == f"*{v.dtype}" and declared["gk"] == f"*{v.gate_dtype}", u.name
        # the loop over time takes the sequences' bounds; the step (one token each) takes neither them nor T
        assert ("cu_seqlens" in arguments(FWD, plan)) == v.varlen, u.name
        assert not {"cu_seqlens", "T"} & set(arguments(STEP, plan)), u.name
        seen.add(v.varlen)
    assert seen == {False, True}


def _variant(K: int, V: int, dtype: str = "bf16") -> SimpleNamespace:
    return SimpleNamespace(name=f"fr_k{K}_v{V}", K=K, V=V, dtype=dtype, gate_dtype="fp32", varlen=False)


@pytest.mark.parametrize("K, V, bk, bv", [(64, 64, 64, 64), (128, 128, 128, 64), (256, 256, 256, 32),
                                          (20, 36, 32, 64), (32, 16, 32, 16), (512, 64, 512, 16)])
def test_tiles(K: int, V: int, bk: int, bv: int) -> None:
    """K padded to a power of two; V tile: V padded, at most 64 and 8192 / BK (the fp32 state tile's budget)."""
    plan = plan_fused_recurrent(_variant(K, V), SimpleNamespace(block_v=None))
    assert (plan.block_k, plan.block_v) == (bk, bv)


def test_block_v_knob_is_taken() -> None:
    plan = plan_fused_recurrent(_variant(128, 128), SimpleNamespace(block_v=32))
    assert (plan.block_v, plan.block_v_step) == (32, 32)  # no step knobs: the step takes the forward's
    plan = plan_fused_recurrent(_variant(128, 128), SimpleNamespace(block_v=32), SimpleNamespace(block_v=None))
    assert (plan.block_v, plan.block_v_step) == (32, 64)
    plan = plan_fused_recurrent(_variant(64, 64), SimpleNamespace(block_v=None), SimpleNamespace(block_v=16))
    assert (plan.block_v, plan.block_v_step) == (64, 16)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"fr_k64_v64: dtype 'int8'; valid: \['bf16', 'fp16', 'fp32'\]"):
        plan_fused_recurrent(_variant(64, 64, "int8"), SimpleNamespace(block_v=None))
    u = next(u for u in spec_units("ada.yaml") if u.variant.op == "chunk")
    with pytest.raises(ValueError, match=rf"{u.name}.*only 'fused_recurrent' units"):
        fused_recurrent_plan(u)

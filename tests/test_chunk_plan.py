"""The chunk kernel plan (dplr_gen/plan/chunk_plan.py): the one place a chunk unit's tiles and passes are decided;
the rendered tables the driver launches from carry its values."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from dplr_gen.plan.chunk_kernels import arguments, conditions, kernels
from dplr_gen.plan.chunk_plan import chunk_plan

from .helpers import rendered_module as _rendered, spec_units as _units


@pytest.mark.parametrize("spec", ["hopper.yaml", "ada.yaml"])
def test_rendered_tables_carry_the_plan(spec: str, tmp_path: Path) -> None:
    """Every chunk unit's CONSTEXPRS and OPTIONS (what the driver reads) hold the plan's tiles and passes."""
    chunk_units = [u for u in _units(spec) if u.variant.op == "chunk"]
    assert chunk_units
    for u in chunk_units:
        plan, ns = chunk_plan(u), _rendered(u, tmp_path)
        ce, opts = ns["CONSTEXPRS"], ns["OPTIONS"]
        assert ce["chunk_dplr_prep_kernel"] == {"K": u.variant.K, "BC": plan.chunk, "BK": plan.block_k}, u.name
        assert ce["chunk_dplr_fwd_kernel"]["BV"] == plan.block_v_fwd, u.name
        assert ce["chunk_dplr_bwd_dh_kernel"]["BV"] == plan.block_v_dh, u.name
        bwd = ce["chunk_dplr_bwd_kernel"]
        assert (bwd["BC"], bwd["BK"], bwd["BV"]) == (plan.token_chunk, plan.block_k_bwd, plan.block_v_bwd), u.name
        assert opts["states_every"] == plan.states_every, u.name
        assert (opts["segments"], opts["segments_bwd"]) == (plan.segments, plan.segments_bwd), u.name
        assert opts["overlap_state_passes"] is plan.overlap_state_passes, u.name
        assert ("chunk_dplr_fwd_small_kernel" in ce) == (plan.knobs_fwd_small is not None), u.name
        if plan.knobs_fwd_small is not None:
            assert ce["chunk_dplr_fwd_small_kernel"]["BV"] == plan.block_v_fwd_small, u.name
        assert ns["TOKEN_DERIVES"] == plan.derive_states == (plan.states_every > plan.token_chunk), u.name


def test_block_v_knob_is_clamped_to_the_variant() -> None:
    """hopper.yaml's chunk.fwd.block_v (32 for its K = 64 variants) reaches the plan where the variant allows it:
    at most V padded to a power of two, at least 64 at chunk 64; every tile a power of two."""
    seen = set()
    for u in _units("hopper.yaml"):
        if u.variant.op != "chunk":
            continue
        plan, knob = chunk_plan(u), u.tune["fwd"].block_v
        lo = 64 if plan.chunk >= 64 else 16
        assert plan.block_v_fwd == max(min(knob, plan.block_v_max), lo), (u.name, knob)
        for bv in (plan.block_v_fwd, plan.block_v_dh, plan.block_v_bwd):
            assert bv & (bv - 1) == 0 and lo <= bv <= max(plan.block_v_max, lo), (u.name, bv)
        seen.add(plan.block_v_fwd)
    assert 32 in seen


def test_token_pass_tile_defaults_to_16_under_128_kb_of_shared_memory() -> None:
    """hopper.yaml's units without their token-pass V tile knob: 16 (64 at chunk 64) on ada.yaml's sm_89 (99 KB a
    block); on sm_90 (227 KB) the state passes' default, which keeps the fp32 [BK, BV] state tiles at 4096."""
    small = next(u for u in _units("ada.yaml") if u.variant.op == "chunk").arch
    assert small.smem_per_block < 131072
    seen = set()
    for u in _units("hopper.yaml"):
        if u.variant.op != "chunk":
            continue
        u = dataclasses.replace(u, tune={**u.tune, "bwd": u.tune["bwd"].model_copy(update={"block_v": None})})
        big = chunk_plan(u)
        lo = 64 if big.token_chunk >= 64 else 16
        assert big.block_v_bwd == max(min(big.block_v_max, 64, 4096 // big.block_k), lo), u.name
        assert chunk_plan(dataclasses.replace(u, arch=small)).block_v_bwd == lo, u.name
        seen.add(big.block_v_bwd)
    assert seen >= {32, 64}, seen


def test_only_chunk_units_have_a_chunk_plan() -> None:
    u = next(u for u in _units("ada.yaml") if u.variant.op == "fused_recurrent")
    with pytest.raises(ValueError, match=rf"{u.name}.*only 'chunk' units"):
        chunk_plan(u)


@pytest.mark.parametrize("spec, split_preps", [("hopper.yaml", False), ("hopper.yaml", True), ("ampere.yaml", False)])
def test_kernels_take_the_declared_arguments(spec: str, split_preps: bool, tmp_path: Path) -> None:
    """Each chunk kernel's def (the Gluon token pass's too, written by hand), its SIGNATURES entry and the
    declaration (plan/chunk_kernels.py, the segmented passes' too) name the same run-time arguments in the same
    order; SIGNATURES holds the declared kernels in the declared order, besides the small-grid copies.
    ``split_preps``: every unit with knob chunk.prep.split_exact turned on (Hopper ships it on its bf16 any-gate
    units only)."""
    seen = set()
    for u in (u for u in _units(spec) if u.variant.op == "chunk"):
        if split_preps:
            prep = u.tune.get("prep", u.tune["fwd"]).model_copy(update={"split_exact": True})
            u = dataclasses.replace(u, tune={**u.tune, "prep": prep})
        plan, flags, ns = chunk_plan(u), SimpleNamespace(**u.flags), _rendered(u, tmp_path)
        names = kernels(plan, flags)
        assert [k for k in ns["SIGNATURES"] if "_small_" not in k] == names, u.name
        for kernel in names:
            declared = arguments(kernel, plan, flags)
            assert list(ns["SIGNATURES"][kernel].items()) == list(declared.items()), (u.name, kernel)
            params = list(ns[kernel].arg_names)
            assert params == list(declared) + list(ns["CONSTEXPRS"][kernel]), (u.name, kernel, params)
        seen |= {k for k, on in conditions(plan, flags).items() if on}
    if spec == "hopper.yaml":
        assert seen == {"clamp", "varlen", "derive", "gluon", "segments", "segments_bwd", "split", "prep_flags",
                        "split_exact"}
    else:
        assert seen >= {"clamp", "varlen"}


def test_segment_passes_take_the_whole_pass_arguments_and_the_maps() -> None:
    """A pass over segments takes its whole pass's arguments with the maps xs and seg_chunks after u (forward)
    or dv (reverse); the reverse maps' kernel takes seg_first right after seg_chunks."""
    u = next(u for u in _units("hopper.yaml") if u.variant.op == "chunk" and chunk_plan(u).segments_bwd)
    plan, flags = chunk_plan(u), SimpleNamespace(**u.flags)
    for whole, seg, after in (("chunk_dplr_fwd_kernel", "chunk_dplr_fwd_seg_kernel", "u"),
                              ("chunk_dplr_fwd_h_kernel", "chunk_dplr_fwd_h_seg_kernel", "u"),
                              ("chunk_dplr_bwd_dh_kernel", "chunk_dplr_bwd_dh_seg_kernel", "dv")):
        names = list(arguments(whole, plan, flags))
        i = names.index(after) + 1
        assert list(arguments(seg, plan, flags)) == names[:i] + ["xs", "seg_chunks"] + names[i:], seg
    maps_bwd = list(arguments("chunk_dplr_seg_maps_bwd_kernel", plan, flags))
    assert maps_bwd[maps_bwd.index("seg_chunks") + 1] == "seg_first"
    with pytest.raises(KeyError, match="no declared chunk kernel"):
        arguments("chunk_dplr_nope_kernel", plan, flags)


@pytest.mark.parametrize("spec", ["ampere.yaml", "ada.yaml", "hopper.yaml", "blackwell.yaml"])
def test_every_shipped_dense_variant_has_the_segment_kernels(spec: str) -> None:
    """Context parallelism's exchange needs the segment maps (dplr_gen/cp.py): every dense chunk unit of every shipped
    spec has the segmented kernels of both directions; the op itself segments only where its spec measured a gain
    (knob segments >= 3: Hopper's bf16, and fp16 at K = 64)."""
    dense = [u for u in _units(spec) if u.variant.op == "chunk" and not u.variant.varlen]
    assert dense
    for u in dense:
        plan = chunk_plan(u)
        assert plan.segments >= 1 and plan.segments_bwd >= 1, u.name
        assert {"chunk_dplr_seg_maps_kernel", "chunk_dplr_seg_maps_bwd_kernel", "chunk_dplr_fwd_seg_kernel",
                "chunk_dplr_bwd_dh_seg_kernel"} <= set(kernels(plan, SimpleNamespace(gluon_token_pass=False))), u.name
        v = u.variant
        walks = not (spec == "hopper.yaml" and (v.dtype == "bf16" or (v.dtype == "fp16" and v.K == 64)))
        assert (plan.segments < 3) == walks and (plan.segments_bwd < 3) == walks, (u.name, plan.segments)

"""Spec models: expansion, filters with reasons, and errors that name the field."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version

from dplr_gen.spec.models import SpecError, load_spec
from dplr_gen.plan.variants import build_units, expand

SPECS = Path(__file__).resolve().parent.parent / "specs"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "t.yaml"  # the stem of the specs' `name: t`
    p.write_text(text)
    return p


GOOD = """
name: t
targets: [sm_80, sm_90]
variants:
  - ops: [chunk, fused_recurrent]
    dtypes: [bf16, fp32]
    head_dims: [64, [60, 100]]
    chunk_sizes: [16, 64]
    varlen: [false]
    gate_bounds: [null, -0.6065]
    dot_precisions: [ieee, tf32]
"""


def test_cross_product_collapses_and_filters(tmp_path: Path) -> None:
    variants, filtered = expand(load_spec(write(tmp_path, GOOD)))
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    # fused_recurrent has no chunk axis: one per (dtype, dims, gate=None, precision)
    fr = [v for v in variants if v.op == "fused_recurrent"]
    assert {v.chunk_size for v in fr} == {None}
    assert all(v.gate_bound is None for v in fr)
    # dot precision only exists for fp32
    assert {v.dot_precision for v in variants if v.dtype == "bf16"} == {None}
    assert {v.dot_precision for v in variants if v.dtype == "fp32"} == {"ieee", "tf32"}
    # filtered combinations keep their reason
    reasons = {f.what: f.reason for f in filtered}
    assert "fused_recurrent_fp32_k64_v64_dense_gbm0p6065_gfp32_sfp32_ieee" in reasons
    assert "chunk_fp32_k64_v64_c64_dense_gany_gfp32_sfp32_ieee" in reasons
    assert "chunk_fp32_k64_v64_c64_dense_gany_gfp32_sfp32_tf32" not in reasons
    assert any(v.K == 60 and v.V == 100 for v in variants)


def test_names_spell_every_parameter(tmp_path: Path) -> None:
    variants, _ = expand(load_spec(write(tmp_path, GOOD)))
    v = next(v for v in variants if v.op == "chunk" and v.gate_bound == -0.6065 and v.dtype == "fp32"
             and v.K == 60 and v.dot_precision == "tf32" and v.chunk_size == 64)
    assert v.name == "chunk_fp32_k60_v100_c64_dense_gbm0p6065_gfp32_sfp32_tf32"


def test_small_grid_stages_only_where_tuned(tmp_path: Path) -> None:
    text = GOOD + ("variant_tuning:\n  - when: {K: [64]}\n    tuning:\n"
                   "      chunk.fwd_small: {num_warps: 4, block_v: 16}\n      chunk.bwd_dh_small: {num_warps: 4}\n")
    units, _ = build_units(load_spec(write(tmp_path, text)), Version("3.6.0"))
    chunk = [u for u in units if u.variant.op == "chunk"]
    for u in chunk:
        assert ("fwd_small" in u.tune) == ("bwd_dh_small" in u.tune) == (u.variant.K == 64), u.name
        assert {"prep", "fwd", "bwd_dh", "bwd"} <= set(u.tune)
    u = next(u for u in chunk if u.variant.K == 64)
    assert (u.tune["fwd_small"].num_warps, u.tune["fwd_small"].block_v) == (4, 16)


def test_stage_warp_cap_holds_for_its_copy(tmp_path: Path) -> None:
    # a quirk's cap on chunk.fwd / chunk.bwd_dh caps the small-grid copies of those kernels too
    from dplr_gen.spec.arch import get_arch
    from dplr_gen.plan.variants import _resolve_knobs

    text = GOOD + ("tuning:\n  chunk.fwd_small: {num_warps: 4}\n  chunk.bwd_dh_small: {num_warps: 4}\n"
                   "  chunk.bwd: {num_warps: 4}\n")
    spec = load_spec(write(tmp_path, text))
    v = next(v for v in expand(spec)[0] if v.op == "chunk")
    knobs = _resolve_knobs(spec, get_arch("sm_90"), v, {"stage_max_num_warps": {"chunk.fwd": 1, "chunk.bwd_dh": 2}})
    assert (knobs["fwd_small"].num_warps, knobs["bwd_dh_small"].num_warps, knobs["bwd"].num_warps) == (1, 2, 4)


def test_units_per_target_carry_flags(tmp_path: Path) -> None:
    units, _ = build_units(load_spec(write(tmp_path, GOOD)), Version("3.6.0"))
    by_target = {u.target: u for u in units}
    assert by_target["sm_90"].flags["no_mma_chaining"] is True
    assert by_target["sm_80"].flags["no_mma_chaining"] is False
    assert all(k.num_warps and k.num_stages for u in units for k in u.tune.values())


def test_old_triton_limits_warps_on_hopper(tmp_path: Path) -> None:
    text = GOOD + "tuning:\n  chunk.fwd: {num_warps: 8}\n"
    units, _ = build_units(load_spec(write(tmp_path, text)), Version("3.1.0"))
    hopper = [u for u in units if u.target == "sm_90" and u.variant.op == "chunk"]
    assert hopper and all(u.tune["fwd"].num_warps <= 4 for u in hopper)
    assert all(u.quirks for u in hopper)


def test_variant_tuning_rules_apply_in_order_after_target_tuning(tmp_path: Path) -> None:
    text = GOOD + (
        "tuning:\n  chunk.bwd: {num_warps: 4, block_v: 64}\n"
        "target_tuning:\n  sm_90:\n    chunk.bwd: {block_v: 32, num_stages: 3}\n"
        "variant_tuning:\n"
        "  - when: {K: [60]}\n    tuning:\n      chunk.bwd: {block_v: 16}\n"
        "  - when: {K: [60], target: [sm_90]}\n    tuning:\n      chunk.bwd: {num_warps: 2}\n"
    )
    units, _ = build_units(load_spec(write(tmp_path, text)), Version("3.6.0"))
    knobs = {(u.target, u.variant.K): u.tune["bwd"] for u in units if u.variant.op == "chunk"}
    assert (knobs["sm_80", 64].block_v, knobs["sm_80", 64].num_warps) == (64, 4)
    assert (knobs["sm_90", 64].block_v, knobs["sm_90", 64].num_stages) == (32, 3)
    assert (knobs["sm_80", 60].block_v, knobs["sm_80", 60].num_warps) == (16, 4)
    assert (knobs["sm_90", 60].block_v, knobs["sm_90", 60].num_warps, knobs["sm_90", 60].num_stages) == (16, 2, 3)


def test_quirk_caps_win_over_variant_tuning(tmp_path: Path) -> None:
    text = GOOD + "variant_tuning:\n  - when: {chunk_size: [64]}\n    tuning:\n      chunk.bwd: {num_warps: 8}\n"
    units, _ = build_units(load_spec(write(tmp_path, text)), Version("3.6.0"))
    bwd = {(u.target, u.variant.chunk_size): u.tune["bwd"].num_warps for u in units if u.variant.op == "chunk"}
    assert bwd["sm_80", 64] == 8
    assert bwd["sm_90", 64] == 2  # hopper-wy-backward-4-warps-wrong: chunk 64 only
    assert bwd["sm_90", 16] == 4  # arch default, uncapped at chunk 16


@pytest.mark.parametrize(
    "text, field",
    [
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf17], head_dims: [64]}]\n", "variants.0.dtypes.0"),
        ("name: t\ntargets: [sm_81]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n", "targets"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [8]}]\n", "variants.0.head_dims"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64], chunk_sizes: [48]}]\n",
         "variants.0.chunk_sizes.0"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64], colour: red}]\n",
         "variants.0.colour"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64], gate_bounds: [0.5]}]\n",
         "variants.0.gate_bounds.0"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\ntuning: {chunk.fwdd: {}}\n",
         "unknown stage 'chunk.fwdd'"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.fwd: {block_v: 48}}\n", "tuning.chunk.fwd.block_v"),
        ("name: T-1\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n", "name"),
        ("- just a list\n", "a spec is a mapping"),
        ("name: [unclosed\n", "not valid YAML"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "variant_tuning: [{when: {head_dim: [64]}, tuning: {chunk.bwd: {block_v: 16}}}]\n",
         "variant_tuning.0.when"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "variant_tuning: [{when: {K: [64]}, tuning: {chunk.bwdd: {block_v: 16}}}]\n",
         "unknown stage 'chunk.bwdd'"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "variant_tuning: [{when: {target: [sm_90]}, tuning: {chunk.bwd: {block_v: 16}}}]\n",
         "not in targets"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.fwd: {chunk: 32}}\n", "tuning.chunk.fwd.chunk: only chunk.bwd"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.bwd: {chunk: 64}}\n", "tuning.chunk.bwd.chunk"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.bwd: {overlap: true}}\n", "tuning.chunk.bwd.overlap: only chunk.bwd_dh"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.bwd_dh: {overlap: sometimes}}\n", "tuning.chunk.bwd_dh.overlap"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.bwd: {max_registers: 300}}\n", "tuning.chunk.bwd.max_registers"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.fwd: {block_k: 32}}\n", "tuning.chunk.fwd.block_k: only chunk.bwd"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.fwd: {launch_below_sms: 4}}\n",
         "tuning.chunk.fwd.launch_below_sms: only chunk.fwd_small, chunk.bwd_dh_small"),
        ("name: t\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"
         "tuning: {chunk.fwd_small: {launch_below_sms: 0}}\n", "tuning.chunk.fwd_small.launch_below_sms"),
    ],
)
def test_bad_specs_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, text))
    assert field in str(e.value)
    assert "t.yaml" in str(e.value)


def test_unknown_arch_lists_known(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, "name: t\ntargets: [sm_81]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n"))
    assert "sm_81" in str(e.value) and "sm_90" in str(e.value) and "arches.yaml" in str(e.value)


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_load(path: Path) -> None:
    variants, _ = expand(load_spec(path))
    assert variants


def test_fp32_wide_chunk_is_refused_on_99kb_archs(tmp_path: Path) -> None:
    text = ("name: t\ntargets: [sm_86, sm_90]\nvariants:\n  - ops: [chunk, fused_recurrent]\n    dtypes: [fp32, bf16]\n"
            "    head_dims: [256, [128, 256]]\n    chunk_sizes: [16]\n    varlen: [false]\n")
    units, refused = build_units(load_spec(write(tmp_path, text)), Version("3.6.0"))
    why = {f.what: f.reason for f in refused}
    assert "120 KB" in why["chunk_fp32_k256_v256_c16_dense_gany_gfp32_sfp32_ieee__sm_86"]
    built = {u.name for u in units}
    assert "chunk_fp32_k256_v256_c16_dense_gany_gfp32_sfp32_ieee__sm_90" in built
    assert "chunk_fp32_k128_v256_c16_dense_gany_gfp32_sfp32_ieee__sm_86" in built  # K <= 128 fits
    assert "chunk_bf16_k256_v256_c16_dense_gany_gfp32_sfp32__sm_86" in built
    assert "fused_recurrent_fp32_k256_v256_dense_gany_gfp32_sfp32_ieee__sm_86" in built


def test_shipped_hopper_small_grid_passes_capped_under_triton_3_1() -> None:
    # registry entry hopper-small-grid-passes-segv-triton-3-1: 4-warp small-grid passes abort Triton 3.1 on
    # sm_90 (varlen and dense); the shipped spec's copies drop to 2 warps there and keep 4 from Triton 3.2 on
    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / "hopper.yaml")
    for version, varlen, warps in (("3.1.0", True, 2), ("3.1.0", False, 2), ("3.2.0", True, 4), ("3.2.0", False, 4),
                                   ("3.6.0", True, 4)):
        units, _ = build_units(spec, Version(version))
        u = next(u for u in units if u.variant.op == "chunk" and u.variant.K == 128 and u.variant.dtype == "bf16"
                 and u.variant.gate_bound is not None and u.variant.varlen == varlen)
        assert (u.tune["fwd_small"].num_warps, u.tune["bwd_dh_small"].num_warps) == (warps, warps), (version, varlen)
        assert ("hopper-small-grid-passes-segv-triton-3-1" in u.quirks) == (warps == 2)


def test_token_pass_chunk_knob_reaches_the_rendered_kernels(tmp_path: Path) -> None:
    """chunk.bwd.chunk sets the token pass's BC (never below the variant's chunk), and only its."""
    from dplr_gen.render.render import render_unit

    text = GOOD + "tuning:\n  chunk.bwd: {chunk: 32}\n"
    units, _ = build_units(load_spec(write(tmp_path, text)), Version("3.6.0"))
    seen = set()
    for u in units:
        if u.variant.op != "chunk" or u.target != "sm_80" or u.variant.dtype != "bf16" or u.variant.K != 64:
            continue
        assert u.tune["bwd"].chunk == 32
        ns: dict = {}
        exec(compile(render_unit(u), u.name, "exec"), ns)  # noqa: S102 - our own rendered source
        C = u.variant.chunk_size
        assert ns["CONSTEXPRS"]["chunk_dplr_bwd_kernel"]["BC"] == max(32, C)
        assert all(ns["CONSTEXPRS"][k]["BC"] == C for k in ns["CONSTEXPRS"] if k != "chunk_dplr_bwd_kernel")
        seen.add(C)
    assert seen == {16, 64}


def test_overlap_knob_reaches_the_rendered_options(tmp_path: Path) -> None:
    """chunk.bwd_dh.overlap becomes the source's OPTIONS["overlap_state_passes"] (the driver's switch); a
    variant_tuning rule may turn it on for some variants only; off by default."""
    from dplr_gen.render.render import render_unit

    text = GOOD + ("tuning:\n  chunk.bwd_dh: {overlap: false}\n"
                   "variant_tuning:\n  - when: {K: [64]}\n    tuning:\n      chunk.bwd_dh: {overlap: true}\n")
    units, _ = build_units(load_spec(write(tmp_path, text)), Version("3.6.0"))
    seen = {}
    for u in units:
        if u.variant.op != "chunk":
            continue
        ns: dict = {}
        exec(compile(render_unit(u), u.name, "exec"), ns)  # noqa: S102 - our own rendered source
        seen.setdefault(u.variant.K, set()).add(ns["OPTIONS"]["overlap_state_passes"])
    assert seen and all(v == {k == 64} for k, v in seen.items()), seen
    units, _ = build_units(load_spec(write(tmp_path, GOOD)), Version("3.6.0"))
    u = next(u for u in units if u.variant.op == "chunk")
    ns = {}
    exec(compile(render_unit(u), u.name, "exec"), ns)  # noqa: S102
    assert ns["OPTIONS"]["overlap_state_passes"] is False


def test_states_every_is_checked_per_variant(tmp_path: Path) -> None:
    """chunk.bwd.states_every: twice the chunk size where the token pass walks the variant's chunks (it reaches
    the rendered OPTIONS); any other value is refused naming the knob, the variant and the valid values."""
    from dplr_gen.render.render import render_unit

    rule = "variant_tuning:\n  - when: {chunk_size: [16]}\n    tuning:\n      chunk.bwd: {states_every: %d%s}\n"
    units, _ = build_units(load_spec(write(tmp_path, GOOD + rule % (32, ""))), Version("3.6.0"))
    seen = set()
    for u in units:
        if u.variant.op == "chunk" and u.variant.chunk_size == 16:
            ns: dict = {}
            exec(compile(render_unit(u), u.name, "exec"), ns)  # noqa: S102 - our own rendered source
            seen.add(ns["OPTIONS"]["states_every"])
            assert "_kept_step" in ns
    assert seen == {32}
    for every, extra, valid in ((64, "", r"\[16, 32\]"), (64, ", chunk: 32", r"\[32\]")):
        with pytest.raises(SpecError, match=rf"_c16_.*chunk.bwd.states_every = {every}.*valid: {valid}"):
            build_units(load_spec(write(tmp_path, GOOD + rule % (every, extra))), Version("3.6.0"))


def test_register_cap_reaches_the_launch_table(tmp_path: Path) -> None:
    """chunk.bwd.max_registers becomes the token pass's LAUNCH option maxnreg (Triton's compiler option), for the
    variants its rule matches; every other kernel's launch options stay warps and stages only."""
    from dplr_gen.render.render import render_unit

    text = GOOD + "variant_tuning:\n  - when: {K: [64]}\n    tuning:\n      chunk.bwd: {max_registers: 168}\n"
    units, _ = build_units(load_spec(write(tmp_path, text)), Version("3.6.0"))
    seen = set()
    for u in units:
        ns: dict = {}
        exec(compile(render_unit(u), u.name, "exec"), ns)  # noqa: S102 - our own rendered source
        for kernel, launch in ns["LAUNCH"].items():
            capped = u.variant.op == "chunk" and u.variant.K == 64 and kernel == "chunk_dplr_bwd_kernel"
            assert launch.get("maxnreg") == (168 if capped else None), (u.name, kernel, launch)
            assert set(launch) <= {"num_warps", "num_stages", "maxnreg"}
            seen.add(capped)
    assert seen == {True, False}


GLUON_RULE = """variant_tuning:
  - when: {%s}
    tuning:
      chunk.bwd: {gluon: true, num_warps: 4}
"""


def test_gluon_token_pass_where_the_knob_and_the_triton_release_allow(tmp_path: Path) -> None:
    """chunk.bwd.gluon: the variants its rule matches get the Gluon token pass under a Triton release in
    GLUON_TRITON (the Triton form kept beside it as TRITON_FORMS, for the interpreter), the Triton form alone
    under any other release and for every other variant; the rendered sources execute."""
    from dplr_gen.render.render import render_unit
    from dplr_gen.toolchain.compile import import_source
    from dplr_gen.toolchain.triton_source import is_gluon
    from dplr_gen.plan.variants import GLUON_TRITON

    text = GOOD + GLUON_RULE % "op: [chunk], K: [64], dtype: [bf16], chunk_size: [16], gate_bound: [-0.6065]"
    spec = load_spec(write(tmp_path, text))
    for version in ("3.6.0", "3.5.1", "3.7.0", "3.2.0"):
        gluon_on = Version(version) in GLUON_TRITON
        units, _ = build_units(spec, Version(version))
        seen = set()
        for u in (u for u in units if u.variant.op == "chunk"):
            v = u.variant
            eligible = (v.K, v.dtype, v.chunk_size, v.gate_bound) == (64, "bf16", 16, -0.6065)
            assert u.flags["gluon_token_pass"] == (eligible and gluon_on), (version, u.name)
            if version in ("3.6.0", "3.2.0"):
                src = render_unit(u)
                path = tmp_path / f"{u.name}_{version}.py"  # (Gluon's decorator reads the source file)
                path.write_text(src)
                ns = vars(import_source(path, f"gluon_case_{u.name}_{version.replace('.', '_')}"))
                gluon = u.flags["gluon_token_pass"]
                assert is_gluon(ns["chunk_dplr_bwd_kernel"]) == gluon
                assert ("TRITON_FORMS" in ns) == gluon
                if gluon:
                    assert ns["TRITON_FORMS"]["chunk_dplr_bwd_kernel"] is ns["chunk_dplr_bwd_triton_kernel"]
                    assert "GATE_BOUND = gl.constexpr(-0.6065)" in src
            seen.add(u.flags["gluon_token_pass"])
        assert seen == ({True, False} if gluon_on else {False}), version
    assert Version("3.6.0") in GLUON_TRITON


@pytest.mark.parametrize("when, what", [
    ("K: [64], dtype: [bf16, fp32], chunk_size: [16], gate_bound: [-0.6065]", r"dtype fp32 \(bf16 only\)"),
    ("dtype: [bf16], chunk_size: [16], gate_bound: [-0.6065]", r"K, V = 60, 100 \(64, 64 or 128, 128\)"),
    ("K: [64], dtype: [bf16], chunk_size: [64], gate_bound: [-0.6065]", r"chunk size 64"),
    ("dtype: [bf16], chunk_size: [16], gate_bound: [null]", r"K, V = 60, 100 \(64, 64 or 128, 128\)"),
])
def test_gluon_knob_outside_its_variants_is_refused(tmp_path: Path, when: str, what: str) -> None:
    """chunk.bwd.gluon on a variant the Gluon kernel does not cover: SpecError naming the variant, the knob and
    what is off (where the release would build the Gluon form)."""
    spec = load_spec(write(tmp_path, GOOD + GLUON_RULE % ("op: [chunk], " + when)))
    with pytest.raises(SpecError, match=r"variant chunk_.*tuning chunk.bwd.gluon: .*" + what):
        build_units(spec, Version("3.6.0"))
    build_units(spec, Version("3.2.0"))  # there the knob is a no-op: nothing to refuse


def test_gluon_token_pass_any_gate_splits_by_chunk(tmp_path: Path) -> None:
    """chunk.bwd.gluon on an any-gate K = 64 variant: the token pass split by chunk (the Gluon kernel for the
    chunks the backward's prep flags, the Triton form declared beside it as a kernel of its own, with the flags'
    arguments); bounded variants keep the one Gluon kernel. The rendered sources execute."""
    from dplr_gen.render.render import render_unit
    from dplr_gen.toolchain.compile import import_source
    from dplr_gen.toolchain.triton_source import is_gluon

    spec = load_spec(write(tmp_path, GOOD + GLUON_RULE % "op: [chunk], K: [64], dtype: [bf16], chunk_size: [16]"))
    units, _ = build_units(spec, Version("3.6.0"))
    seen = set()
    for u in (u for u in units if u.flags["gluon_token_pass"]):
        split = u.variant.gate_bound is None
        src = render_unit(u)
        path = tmp_path / f"{u.name}.py"
        path.write_text(src)
        ns = vars(import_source(path, f"split_case_{u.name}"))
        assert is_gluon(ns["chunk_dplr_bwd_kernel"])
        assert (ns["OPTIONS"].get("split_token_pass") == "chunk_dplr_bwd_triton_kernel") == split, u.name
        assert ("chunk_dplr_bwd_triton_kernel" in ns["SIGNATURES"]) == split
        for kernel in ("chunk_dplr_bwd_kernel", "chunk_dplr_prep_bwd_kernel"):
            assert ("fac" in ns["SIGNATURES"][kernel]) == split, (u.name, kernel)
        assert ("form" in ns["SIGNATURES"]["chunk_dplr_bwd_kernel"]) == split
        seen.add(split)
    assert seen == {True, False}


K128 = """
name: t
targets: [sm_90]
variants:
  - ops: [chunk]
    dtypes: [bf16]
    head_dims: [128]
    chunk_sizes: [16]
    varlen: [false, true]
    gate_bounds: [-0.61]
variant_tuning:
  - when: {op: [chunk]}
    tuning:
      chunk.bwd: {num_warps: 4, block_v: 64, block_k: 64%s}
  - when: {%s}
    tuning:
      chunk.bwd: {gluon: true}
"""


@pytest.mark.parametrize("bound", ["-0.61", "null"])
def test_gluon_token_pass_k128_dense_deriving(tmp_path: Path, bound: str) -> None:
    """The K = 128 Gluon form: a dense variant keeping every second state gets it (the derive form rendered, its
    Triton form kept for the interpreter, n_items last in both signatures, the functions' arguments those the
    plan declares); the rendered source executes. Any gate: the pass split by chunk, both kernels taking the
    prep's flags, the Triton form a persistent kernel of its own."""
    from dplr_gen.toolchain.compile import import_source
    from dplr_gen.render.render import render_unit
    from dplr_gen.toolchain.triton_source import is_gluon

    spec = K128.replace("gate_bounds: [-0.61]", f"gate_bounds: [{bound}]")
    units, _ = build_units(load_spec(write(tmp_path, spec % (", states_every: 32", "varlen: [false]"))),
                           Version("3.6.0"))
    (u,) = [u for u in units if u.flags["gluon_token_pass"]]
    assert not u.variant.varlen and u.tune["bwd"].states_every == 32
    assert all(not w.flags["gluon_token_pass"] for w in units if w.variant.varlen)
    src = render_unit(u)
    assert "def _g_kept_step(ST, eg, b_xt, b_yt, b_x, b_y, c):" in src and "def _issue_item(" in src
    path = tmp_path / "k128_gluon.py"
    path.write_text(src)
    ns = vars(import_source(path, "gluon_k128_case"))
    assert is_gluon(ns["chunk_dplr_bwd_kernel"]) and not is_gluon(ns["chunk_dplr_bwd_triton_kernel"])
    assert list(ns["SIGNATURES"]["chunk_dplr_bwd_kernel"])[-1] == "n_items"
    split = bound == "null"
    names = ["chunk_dplr_bwd_kernel", *(["chunk_dplr_bwd_triton_kernel"] if split else [])]
    for name in names:
        sig = list(ns["SIGNATURES"][name])
        assert list(ns[name].arg_names[:len(sig)]) == sig, name
        assert ("fac" in sig and "form" in sig) == split, name
    assert ns["OPTIONS"].get("split_token_pass") == ("chunk_dplr_bwd_triton_kernel" if split else None)
    assert ns["OPTIONS"]["persistent"] == names and ns["OPTIONS"]["states_every"] == 32


@pytest.mark.parametrize("every, when, what", [
    (", states_every: 32", "varlen: [true]", r"states_every 32, varlen True at K = 128 \(dense, states_every 32\)"),
    ("", "varlen: [false]", r"states_every None, varlen False at K = 128"),
])
def test_gluon_knob_k128_outside_its_form_is_refused(tmp_path: Path, every: str, when: str, what: str) -> None:
    """At K = 128 the Gluon token pass is the dense deriving form only: a varlen variant or one keeping a state
    per chunk is refused, naming the variant and the knob."""
    spec = load_spec(write(tmp_path, K128 % (every, when)))
    with pytest.raises(SpecError, match=r"variant chunk_bf16_k128.*tuning chunk.bwd.gluon: .*" + what):
        build_units(spec, Version("3.6.0"))


def test_gluon_knob_only_on_the_token_pass(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"chunk.fwd.gluon: only chunk.bwd take the gluon knob"):
        load_spec(write(tmp_path, GOOD + "tuning:\n  chunk.fwd: {gluon: true}\n"))


def test_segments_knob_dense_variants_only(tmp_path: Path) -> None:
    """chunk.fwd_small.segments: rendered into the dense variants' OPTIONS with the two segmented kernels; on a varlen
    variant a SpecError names the variant, the knob and the way out; on any other stage the knob is refused."""
    from dplr_gen.render.render import render_unit

    rule = "variant_tuning:\n  - when: {%s}\n    tuning:\n      chunk.fwd_small: {segments: 6}\n"
    dense = build_units(load_spec(write(tmp_path, GOOD + rule % "op: [chunk], chunk_size: [16]")), Version("3.6.0"))[0]
    u = next(u for u in dense if u.variant.op == "chunk" and u.variant.chunk_size == 16)
    ns: dict = {}
    exec(compile(render_unit(u), u.name, "exec"), ns)  # noqa: S102 - our own rendered source
    assert ns["OPTIONS"]["segments"] == 6
    assert {"chunk_dplr_seg_maps_kernel", "chunk_dplr_fwd_seg_kernel"} <= set(ns["SIGNATURES"])
    varlen = GOOD.replace("varlen: [false]", "varlen: [false, true]")
    with pytest.raises(SpecError, match=r"variant chunk_.*_varlen_.*chunk.fwd_small.segments = 6: dense variants only"):
        build_units(load_spec(write(tmp_path, varlen + rule % "op: [chunk]")), Version("3.6.0"))
    build_units(load_spec(write(tmp_path, varlen + rule % "op: [chunk], varlen: [false]")), Version("3.6.0"))
    with pytest.raises(SpecError, match=r"chunk.fwd.segments: only chunk.fwd_small"):
        load_spec(write(tmp_path, GOOD + "tuning:\n  chunk.fwd: {segments: 4}\n"))
    # 1 builds the segment kernels (context parallelism's maps) while the op walks whole sequences; 0 is refused
    one = build_units(load_spec(write(tmp_path, GOOD + rule.replace("6", "1") % "op: [chunk], chunk_size: [16]")),
                      Version("3.6.0"))[0]
    ns = {}
    u = next(u for u in one if u.variant.op == "chunk" and u.variant.chunk_size == 16)
    exec(compile(render_unit(u), u.name, "exec"), ns)  # noqa: S102 - our own rendered source
    assert ns["OPTIONS"]["segments"] == 1 and "chunk_dplr_seg_maps_kernel" in ns["SIGNATURES"]
    with pytest.raises(SpecError, match=r"chunk.fwd_small.*segments.*greater than or equal to 1"):
        load_spec(write(tmp_path, GOOD + "tuning:\n  chunk.fwd_small: {segments: 0}\n"))


def test_split_exact_knob_reaches_the_any_gate_units_only(tmp_path: Path) -> None:
    """chunk.prep.split_exact: the any-gate units it matches get the preps' exact kernels (declared, and named in
    OPTIONS for the driver); a bounded unit under the same rule renders as without the knob; on another stage it
    is refused. Shipped: Hopper's bf16 any-gate units take it (beside the lazy gate sums), no other unit."""
    from dplr_gen.plan.chunk_kernels import kernels
    from dplr_gen.plan.chunk_plan import chunk_plan
    from dplr_gen.render.render import render_unit

    exact = ["chunk_dplr_prep_exact_kernel", "chunk_dplr_prep_bwd_exact_kernel"]
    rule = "variant_tuning:\n  - when: {op: [chunk]}\n    tuning:\n      chunk.prep: {split_exact: true}\n"
    on = build_units(load_spec(write(tmp_path, GOOD + rule)), Version("3.6.0"))[0]
    off = {u.name: u for u in build_units(load_spec(write(tmp_path, GOOD)), Version("3.6.0"))[0]}
    chunk = [u for u in on if u.variant.op == "chunk"]
    assert {u.variant.gate_bound for u in chunk} == {None, -0.6065}
    for u in chunk:
        src = render_unit(u)
        if u.variant.gate_bound is None:
            assert chunk_plan(u).split_exact and all(f"def {k}(" in src for k in exact), u.name
            assert kernels(chunk_plan(u), SimpleNamespace(**u.flags))[-2:] == exact and 'OPTIONS["split_exact"]' in src, u.name
        else:
            assert "_exact_kernel" not in src and src == render_unit(off[u.name]), u.name
    with pytest.raises(SpecError, match=r"chunk.fwd.split_exact: only chunk.prep take the split_exact knob"):
        load_spec(write(tmp_path, GOOD + "tuning:\n  chunk.fwd: {split_exact: true}\n"))
    for spec in sorted(SPECS.glob("*.yaml")):
        units = [u for u in build_units(load_spec(spec), Version("3.6.0"))[0] if u.variant.op == "chunk"]
        split = {u.name for u in units if chunk_plan(u).split_exact}
        want = {u.name for u in units if spec.name == "hopper.yaml" and u.variant.dtype == "bf16"
                and u.variant.gate_bound is None}
        assert split == want and (spec.name != "hopper.yaml" or want), spec.name


def test_lazy_exact_gates_knob_reaches_the_any_gate_units_only(tmp_path: Path) -> None:
    """chunk.prep.lazy_exact_gates: the any-gate units it matches render the lazy gate sums; a bounded unit under
    the same rule renders as without the knob (its gates always factor); on another stage it is refused; and the
    shipped Hopper spec has it on its bf16 any-gate variants only."""
    from dplr_gen.plan.chunk_plan import chunk_plan
    from dplr_gen.render.render import render_unit

    rule = "variant_tuning:\n  - when: {op: [chunk]}\n    tuning:\n      chunk.prep: {lazy_exact_gates: true}\n"
    on = build_units(load_spec(write(tmp_path, GOOD + rule)), Version("3.6.0"))[0]
    off = {u.name: u for u in build_units(load_spec(write(tmp_path, GOOD)), Version("3.6.0"))[0]}
    chunk = [u for u in on if u.variant.op == "chunk"]
    assert {u.variant.gate_bound for u in chunk} == {None, -0.6065}
    for u in chunk:
        lazy = "if not _factorable(gam, gamp, g.shape[0]):" in render_unit(u)
        if u.variant.gate_bound is None:
            assert lazy and chunk_plan(u).lazy_exact_gates, u.name
        else:
            assert not lazy and render_unit(u) == render_unit(off[u.name]), u.name
    with pytest.raises(SpecError, match=r"chunk.bwd.lazy_exact_gates: only chunk.prep take the lazy_exact_gates knob"):
        load_spec(write(tmp_path, GOOD + "tuning:\n  chunk.bwd: {lazy_exact_gates: true}\n"))
    hopper = build_units(load_spec(SPECS / "hopper.yaml"), Version("3.6.0"))[0]
    lazy = {u.name for u in hopper if u.variant.op == "chunk" and chunk_plan(u).lazy_exact_gates}
    expected = {u.name for u in hopper if u.variant.op == "chunk" and u.variant.gate_bound is None
                and u.variant.dtype == "bf16"}
    assert lazy == expected and len(expected) == 8


def test_divisible_t_knob_builds_the_dense_small_grid_copies_again(tmp_path: Path) -> None:
    """Knob divisible_t on the small-grid stages: a dense unit declares the stage's kernels once more for T
    divisible by 16 (the forward's two with chunk.fwd_small, the reverse pass with chunk.bwd_dh_small); a varlen
    unit under the same rule does not; on another stage the knob is refused; the shipped Hopper spec builds them
    for its dense bf16 K = 64 variants only."""
    from dplr_gen.plan.chunk_plan import chunk_plan

    rule = ("variant_tuning:\n  - when: {op: [chunk]}\n    tuning:\n      chunk.fwd_small: {divisible_t: true}\n"
            "      chunk.bwd_dh_small: {num_warps: 1}\n")
    both = GOOD.replace("varlen: [false]", "varlen: [false, true]")
    units = [u for u in build_units(load_spec(write(tmp_path, both + rule)), Version("3.6.0"))[0]
             if u.variant.op == "chunk"]
    assert {u.variant.varlen for u in units} == {False, True}
    for u in units:
        expect = () if u.variant.varlen else ("chunk_dplr_fwd_small_kernel", "chunk_dplr_fwd_h_small_kernel")
        assert chunk_plan(u).divisible_t == expect, u.name
    with pytest.raises(SpecError, match=r"chunk.fwd.divisible_t: only chunk.fwd_small, chunk.bwd_dh_small take"):
        load_spec(write(tmp_path, GOOD + "tuning:\n  chunk.fwd: {divisible_t: true}\n"))
    hopper = [u for u in build_units(load_spec(SPECS / "hopper.yaml"), Version("3.6.0"))[0] if u.variant.op == "chunk"]
    with_copies = {u.name for u in hopper if chunk_plan(u).divisible_t}
    assert with_copies == {u.name for u in hopper if u.variant.K == 64 and u.variant.dtype == "bf16"
                           and not u.variant.varlen} and len(with_copies) == 4
    assert all(len(chunk_plan(u).divisible_t) == 3 for u in hopper if u.name in with_copies)

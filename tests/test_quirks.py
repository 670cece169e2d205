"""The quirk registry: data validation, version/arch matching, merging into flags and limits."""

from __future__ import annotations

from typing import Any

import pytest
from packaging.version import Version
from pydantic import ValidationError

from dplr_gen.spec import quirks as qr

BASE = {"no_mma_chaining": False, "separate_accumulators": False}


def _entry(**over: Any) -> dict[str, Any]:
    e: dict[str, Any] = {
        "id": "x-test",
        "archs": [90],
        "triton": ">=3.1,<3.2",
        "pattern": "p",
        "effect": "abort",
        "reference": "https://example.invalid/1",
        "avoid": {"max_num_warps": 4},
    }
    e.update(over)
    return e


def test_shipped_registry_loads_and_is_cached() -> None:
    qs = qr.load_quirks()
    assert len(qs) >= 9  # the known compiler failures, plus the sm_100/sm_120 targeting entries
    assert qr.load_quirks() is qs
    assert len({q.id for q in qs}) == len(qs)
    effects = {q.effect for q in qs}
    assert effects == {"abort", "miscompile", "compile_error", "hang"}


def test_every_known_compiler_failure_is_encoded() -> None:
    ids = {q.id for q in qr.load_quirks()}
    assert {
        "hopper-mma-to-mma-abort",
        "hopper-chained-dot-reshape-abort",
        "hopper-transposed-dot-result-wrong",
        "hopper-cast-trans-dot-operand-wrong",
        "hopper-wy-backward-4-warps-wrong",
        "sm120-no-tensor-core-dot",
        "blackwell-tmem-hoist-trans-acc",
        "blackwell-shared-accumulator-wrong",
        "global-scratch-needs-allocator",
        "sm100-not-targetable",
    } <= ids


# ------------------------------------------------------------------------------------------ version ranges


@pytest.mark.parametrize(
    "version, expected",
    [
        ("3.0.0", True),
        ("3.1.0", True),
        ("3.1.9", True),
        ("3.2.0", False),
        ("3.2.0rc1", False),  # a pre-release of 3.2 counts as 3.2
        ("3.1.0+git8e1c2", True),  # local builds count as their release
    ],
)
def test_upper_bound_exclusive(version: str, expected: bool) -> None:
    q = qr.parse_quirks([_entry(triton=">=3.0,<3.2")])[0]
    assert q.matches_triton(version) is expected
    assert q.matches_triton(Version(version)) is expected


@pytest.mark.parametrize("version, expected", [("3.3.0", False), ("3.4.0", True), ("3.6.0", True),
                                               ("3.7.0", True), ("3.7.1", False), ("3.8.0", False)])
def test_fixed_in_patch_release(version: str, expected: bool) -> None:
    hit = [q.id for q in qr.active_quirks(90, version)]
    assert ("hopper-cast-trans-dot-operand-wrong" in hit) is expected


def test_boundaries_on_shipped_registry() -> None:
    ids = lambda v: {q.id for q in qr.active_quirks(90, v)}  # noqa: E731
    assert "hopper-mma-to-mma-abort" in ids("3.1.0")
    assert "hopper-mma-to-mma-abort" not in ids("3.2.0")
    assert "hopper-chained-dot-reshape-abort" in ids("3.2.0")
    assert "hopper-chained-dot-reshape-abort" not in ids("3.1.0") | ids("3.7.0")
    assert "hopper-cast-trans-dot-operand-wrong" in ids("3.7.0")
    assert "hopper-cast-trans-dot-operand-wrong" not in ids("3.7.1")
    assert "hopper-wy-backward-4-warps-wrong" in ids("3.7.1")  # ">= 3.4": still open


# ------------------------------------------------------------------------------------------ arch matching


def test_arch_matching_lists_and_ranges() -> None:
    q = qr.parse_quirks([_entry(archs=[80, "100-103", "sm_120"])])[0]
    assert [a for a in (75, 80, 86, 90, 100, 101, 103, 110, 120) if q.matches_arch(a)] == [80, 100, 101, 103, 120]


def test_arch_matching_on_shipped_registry() -> None:
    # on sm_80 only the fp16 any-gate prep's entry applies, and only before 3.3
    assert [q.id for q in qr.active_quirks(80, "3.1.0")] == ["tf32x3-branch-abort-old-triton"]
    assert qr.active_quirks(80, "3.3.1") == []
    assert qr.active_quirks(86, "3.6.0") == []
    assert all(q.matches_arch(90) for q in qr.active_quirks(90, "3.1.0"))
    assert {q.id for q in qr.active_quirks(103, "3.6.0")} >= {"blackwell-shared-accumulator-wrong"}


# ------------------------------------------------------------------------------------------ arch_flags


def test_sm90_triton31_caps_warps_and_disables_chaining() -> None:
    flags, limits, applied, refusal = qr.arch_flags(90, "3.1.0", BASE)
    assert flags["no_mma_chaining"] is True
    assert limits["max_num_warps"] == 4
    assert "hopper-mma-to-mma-abort" in applied
    assert refusal is None
    assert BASE["no_mma_chaining"] is False  # input not mutated


def test_sm100_triton32_refused() -> None:
    _, _, applied, refusal = qr.arch_flags(100, "3.2.0", BASE)
    assert refusal is not None and "sm_100" in refusal and "sm100-not-targetable" in refusal
    assert "sm100-not-targetable" in applied


def test_sm120_triton32_refused_and_33_not() -> None:
    assert qr.arch_flags(120, "3.2.0", BASE)[3] is not None
    assert qr.arch_flags(120, "3.1.0", BASE)[3] is not None
    flags, limits, _, refusal = qr.arch_flags(120, "3.3.0", BASE)
    assert refusal is None and limits == {"needs_allocator": True}


def test_sm100_recent_separate_accumulators_and_allocator() -> None:
    flags, limits, _, refusal = qr.arch_flags(100, "3.6.0", BASE)
    assert refusal is None
    assert flags["separate_accumulators"] is True
    assert limits["needs_allocator"] is True


def test_stage_caps() -> None:
    # without a variant every entry counts, the chunk-64-only one included
    _, limits, _, _ = qr.arch_flags(90, "3.6.0", BASE)
    assert limits["stage_max_num_warps"] == {"chunk.bwd": 2}
    assert "max_num_warps" not in limits


@pytest.mark.parametrize("chunk, capped", [(16, False), (32, False), (64, True)])
def test_wy_backward_cap_is_limited_to_chunk_64(chunk: int, capped: bool) -> None:
    params = {"op": "chunk", "dtype": "bf16", "chunk_size": chunk, "K": 64, "V": 64}
    _, limits, applied, _ = qr.arch_flags(90, "3.6.0", BASE, variant=params)
    assert ("hopper-wy-backward-4-warps-wrong" in applied) is capped
    assert (limits.get("stage_max_num_warps") == {"chunk.bwd": 2}) is capped
    # Triton 3.2 aborts our chunk backward at 4 warps whatever the chunk: that cap stays
    _, limits, applied, _ = qr.arch_flags(90, "3.2.0", BASE, variant=params)
    assert limits["stage_max_num_warps"] == {"chunk.bwd": 2}


def test_when_matches_listed_values_only() -> None:
    (q,) = qr.parse_quirks([_entry(when={"chunk_size": [32, 64], "dtype": ["bf16"]})])
    assert q.matches_variant({"chunk_size": 64, "dtype": "bf16"})
    assert not q.matches_variant({"chunk_size": 16, "dtype": "bf16"})
    assert not q.matches_variant({"chunk_size": 64, "dtype": "fp16"})
    assert q.matches_variant(None)  # an unknown variant is assumed affected
    assert not q.applies(90, "3.1.0", {"chunk_size": 16, "dtype": "bf16"})
    assert q.applies(90, "3.1.0", {"chunk_size": 32, "dtype": "bf16"})


def test_when_keys_are_the_variant_parameters() -> None:
    from dplr_gen.spec.models import VARIANT_KEYS
    from dplr_gen.plan.variants import Variant

    v = Variant("chunk", "bf16", "fp32", 64, 64, 16, False, -0.61, "fp32", None)
    assert set(v.params()) == VARIANT_KEYS


def test_when_validation_names_field() -> None:
    with pytest.raises(ValidationError, match="chunk_sise"):
        qr.parse_quirks([_entry(when={"chunk_sise": [64]})])
    with pytest.raises(ValidationError, match="no values listed"):
        qr.parse_quirks([_entry(when={"chunk_size": []})])


def test_sm80_untouched() -> None:
    assert qr.arch_flags(80, "3.6.0", BASE) == (BASE, {}, [], None)


def test_merge_takes_smallest_cap_and_keeps_workarounds_on() -> None:
    pool = qr.parse_quirks([
        _entry(id="a", avoid={"max_num_warps": 8, "flags": {"f": True}, "stage_max_num_warps": {"chunk.bwd": 4}}),
        _entry(id="b", avoid={"max_num_warps": 4, "flags": {"f": False, "g": True},
                              "stage_max_num_warps": {"chunk.bwd": 2}}),
        _entry(id="c", avoid={"refuse": "no way"}),
        _entry(id="d", avoid={"refuse": "nope"}),
        _entry(id="other-arch", archs=[80], avoid={"max_num_warps": 1}),
    ])
    flags, limits, applied, refusal = qr.arch_flags(90, "3.1.0", {"f": False, "h": 1}, quirks=pool)
    assert flags == {"f": True, "g": True, "h": 1}
    assert limits == {"max_num_warps": 4, "stage_max_num_warps": {"chunk.bwd": 2}}
    assert applied == ["a", "b", "c", "d"]
    assert refusal == "no way [c]; nope [d]"


# ------------------------------------------------------------------------------------------ validation


def _error_locs(data: Any) -> list[tuple[Any, ...]]:
    with pytest.raises(ValidationError) as ei:
        qr.parse_quirks(data)
    return [e["loc"] for e in ei.value.errors()]


def test_bad_specifier_names_field() -> None:
    locs = _error_locs([_entry(triton=">=3.1,,banana")])
    assert any("triton" in loc for loc in locs)


def test_unknown_effect_names_field() -> None:
    locs = _error_locs([_entry(effect="explodes")])
    assert any("effect" in loc for loc in locs)


def test_extra_key_names_field() -> None:
    locs = _error_locs([_entry(severity="high")])
    assert any("severity" in loc for loc in locs)


def test_extra_key_in_avoid_names_field() -> None:
    locs = _error_locs([_entry(avoid={"max_warps": 4})])
    assert any("max_warps" in loc for loc in locs)


def test_bad_arch_names_field() -> None:
    assert any("archs" in loc for loc in _error_locs([_entry(archs=["hopper"])]))
    assert any("archs" in loc for loc in _error_locs([_entry(archs=[])]))


def test_missing_field_and_duplicate_id() -> None:
    bad = _entry()
    del bad["reference"]
    assert any("reference" in loc for loc in _error_locs([bad]))
    with pytest.raises(ValidationError, match="duplicate quirk id"):
        qr.parse_quirks([_entry(), _entry()])


def test_entries_are_frozen() -> None:
    q = qr.load_quirks()[0]
    with pytest.raises(ValidationError):
        q.effect = "hang"  # type: ignore[misc]

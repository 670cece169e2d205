"""Spec -> variants -> build units: cross product of the axes, then filters that record why a combination
was dropped, then one unit per (variant, target) with its flags and resolved tuning knobs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..spec import quirks as quirk_registry
from ..spec.arch import ArchProfile, get_arch
from ..spec.models import STAGE_COPIES, STAGES, Knobs, Spec, SpecError, VariantAxes, when_matches
from .variant import Variant


@dataclass(frozen=True)
class Filtered:
    what: str
    reason: str


def _axes_product(axes: VariantAxes) -> list[Variant]:
    out: list[Variant] = []
    for op, dtype, hd, cs, vl, gb, dp in itertools.product(
        axes.ops, axes.dtypes, axes.head_dims, axes.chunk_sizes, axes.varlen, axes.gate_bounds,
        axes.dot_precisions,
    ):
        K, V = (hd, hd) if isinstance(hd, int) else hd
        out.append(
            Variant(
                op=op, dtype=dtype, gate_dtype=dtype if axes.gate_dtype == "same" else "fp32", K=K, V=V,
                # axes that do not apply collapse, so the cross product does not repeat a variant
                chunk_size=cs if op == "chunk" else None,
                varlen=vl, gate_bound=gb, state_dtype=axes.state_dtype,
                dot_precision=dp if dtype == "fp32" else None,
            )
        )
    return out


# Each rule: (predicate, reason). A variant matching a predicate is dropped with that reason.
_RULES: list[tuple[Any, str]] = [
    (
        lambda v: v.op == "fused_recurrent" and v.gate_bound is not None,
        "the fused recurrent op handles any gate exactly; a bound adds nothing",
    ),
    (
        # chunk 64 spills registers and takes over 25 minutes to compile in fp32 with ieee dots
        lambda v: v.op == "chunk" and v.dtype == "fp32" and v.dot_precision == "ieee" and v.chunk_size == 64,
        "fp32 with ieee dots at chunk 64 does not compile in reasonable time; use chunk 16/32 or tf32",
    ),
]


def filtered_reason(v: Variant) -> str | None:
    """Why a spec's axes would drop ``v`` (a combination that adds nothing or cannot be built), else None."""
    return next((r for pred, r in _RULES if pred(v)), None)


def expand(spec: Spec) -> tuple[list[Variant], list[Filtered]]:
    """All variants of a spec in a stable order, and what was filtered out with the reason."""
    seen: dict[str, Variant] = {}
    filtered: dict[str, Filtered] = {}
    for axes in spec.variants:
        for v in _axes_product(axes):
            if v.name in seen or v.name in filtered:
                continue
            reason = filtered_reason(v)
            if reason is None:
                seen[v.name] = v
            else:
                filtered[v.name] = Filtered(v.name, reason)
    return sorted(seen.values(), key=lambda v: v.name), sorted(filtered.values(), key=lambda f: f.what)


@dataclass(frozen=True)
class BuildUnit:
    """One variant rendered for one target: a source file, compiled once per kernel."""

    variant: Variant
    arch: ArchProfile
    flags: dict[str, bool]
    tune: dict[str, Knobs]  # stage -> fully resolved knobs
    quirks: tuple[str, ...] = field(default=())

    @property
    def target(self) -> str:
        return self.arch.target

    @property
    def name(self) -> str:
        return f"{self.variant.name}__{self.target}"


def _resolve_knobs(
    spec: Spec, arch: ArchProfile, v: Variant, limits: dict[str, Any], lenient: bool = False
) -> dict[str, Knobs]:
    """Knobs per stage: arch defaults < spec tuning < target_tuning < matching variant_tuning rules < quirk caps.
    ``lenient``: knobs the variant cannot take (states_every, segments) are dropped instead of raising."""
    params = {**v.params(), "target": arch.target}
    rules = [r.tuning for r in spec.variant_tuning if when_matches(r.when, params)]
    out: dict[str, Knobs] = {}
    for stage in STAGES[v.op]:
        key = f"{v.op}.{stage}"
        merged: dict[str, Any] = {"num_warps": arch.defaults.num_warps, "num_stages": arch.defaults.num_stages}
        tables = [t for t in (spec.tuning, spec.target_tuning.get(arch.target, {}), *rules) if key in t]
        original = STAGE_COPIES[v.op].get(stage)
        if not tables and original is not None:
            continue  # not asked for: no such kernel
        for table in tables:
            merged.update(table[key].model_dump(exclude_none=True))
        # quirk caps win over the spec: a knob that provokes a known compiler failure is never used (a copy's
        # kernels are the original's, so the original's cap holds for them too)
        stage_caps = limits.get("stage_max_num_warps", {})
        caps = [limits.get("max_num_warps"), stage_caps.get(key)]
        if original is not None:
            caps.append(stage_caps.get(f"{v.op}.{original}"))
        for cap in caps:
            if cap is not None:
                merged["num_warps"] = min(merged["num_warps"], cap)
        out[stage] = Knobs(**merged)
    if v.op == "chunk":
        checks = [("bwd", "states_every", lambda: check_states_every(v, out["bwd"]))]
        checks += [(st, "segments", lambda st=st: check_segments(v, st, out.get(st))) for st in ("fwd_small", "bwd_dh_small")]
        for stage, knob, check in checks:
            try:
                check()
            except SpecError:
                if not lenient:
                    raise
                out[stage] = out[stage].model_copy(update={knob: None})
        if lenient:
            # the segmented state passes are tuned for the spec's own head dims and do not build at others on
            # sm_90 (K = 16: a conversion between MMA layouts; K = 256: 262 KB of shared memory): a variant
            # generated on demand walks whole sequences
            for stage in ("fwd_small", "bwd_dh_small"):
                if stage in out and out[stage].segments:
                    out[stage] = out[stage].model_copy(update={"segments": None})
    return out


# Triton releases whose Gluon API (triton.experimental.gluon: linear layouts, mma_v2, reshape / permute of register
# tensors) dplr_gen/render/templates/chunk_dplr_bwd_gluon.py.jinja is written against: an experimental API, so a release not
# checked builds the Triton form of the token pass instead (the knob is then a no-op, shown in the unit's flags).
# (A release outside this range does not check the knob's variants either: see check_gluon.)
GLUON_TRITON = SpecifierSet(">=3.6,<3.7")

# The factored form's exponents (gamma - gamma_r, re-centred at row C/2 - 1) stay within +-FACTOR_LIMIT: e^30 leaves
# fp32 and bf16 room for the products. The templates read both names (render.environment's globals).
FACTOR_LIMIT = 30


def factored(chunk: int, gate_bound: float | None) -> bool:
    """Whether a bounded variant's chunks of ``chunk`` tokens take the factored form at render time: every exponent
    is at most chunk * |bound| / 2 in magnitude."""
    return gate_bound is not None and chunk * -gate_bound / 2 <= FACTOR_LIMIT


def check_gluon(v: Variant, bwd: Knobs) -> None:
    """Knob chunk.bwd.gluon: the Gluon token pass covers bf16, the variant's 16-token chunks, bounded gates whose
    factored exponents stay within the limit, 4 warps and 64-wide K blocks and V tiles, in two forms: K = V = 64
    with a state kept for each chunk (dense or varlen), and K = V = 128, dense, with a state kept for every second
    chunk (states_every 32: it derives the others). Any gate: the pass split by chunk, the Gluon kernel taking
    the chunks whose gates allow the factored form (chunk_kernels.splits_token_pass). SpecError naming the
    variant and what is off otherwise."""
    if not bwd.gluon:
        return
    off = []
    if v.dtype != "bf16":
        off.append(f"dtype {v.dtype} (bf16 only)")
    every = bwd.states_every or 16
    if v.chunk_size != 16 or (bwd.chunk or 16) != 16:
        off.append(f"chunk size {v.chunk_size}, chunk.bwd.chunk {bwd.chunk} (16-token chunks)")
    elif (v.K, v.V) == (64, 64) and every != 16:
        off.append(f"states_every {bwd.states_every} at K = 64 (a state kept for each chunk: 16)")
    elif (v.K, v.V) == (128, 128) and (every != 32 or v.varlen):
        off.append(f"states_every {bwd.states_every}, varlen {v.varlen} at K = 128 (dense, states_every 32)")
    if (v.K, v.V) not in ((64, 64), (128, 128)):
        off.append(f"K, V = {v.K}, {v.V} (64, 64 or 128, 128)")
    if v.gate_bound is not None and not factored(16, v.gate_bound):
        off.append(f"gate bound {v.gate_bound} (bounded, at most {2 * FACTOR_LIMIT / 16} in magnitude, or any gate)")
    if bwd.num_warps != 4 or (bwd.block_v or 64) != 64 or (bwd.block_k or 64) != 64:
        off.append(f"num_warps {bwd.num_warps}, block_v {bwd.block_v}, block_k {bwd.block_k} (4 warps, 64, 64)")
    if off:
        raise SpecError(f"variant {v.name}: tuning chunk.bwd.gluon: the Gluon token pass does not cover "
                        + "; ".join(off) + " (limit the rule with `when`, e.g. {K: [64], dtype: [bf16]})")


def check_states_every(v: Variant, bwd: Knobs) -> None:
    """Knob chunk.bwd.states_every is the token pass's chunk, or twice the variant's chunk size where the token
    pass walks the variant's chunks (it derives one state of each pair); SpecError naming the variant otherwise."""
    tc = max(bwd.chunk or v.chunk_size, v.chunk_size)
    every = bwd.states_every
    if every is None or every == tc:
        return
    if tc != v.chunk_size or every != 2 * tc:
        valid = sorted({tc} | ({2 * tc} if tc == v.chunk_size else set()))
        raise SpecError(
            f"variant {v.name}: tuning chunk.bwd.states_every = {every} with a {tc}-token token pass (chunk.bwd.chunk"
            f" {bwd.chunk or 'unset'}, chunk size {v.chunk_size}); valid: {valid} (the token pass's chunk, or twice the chunk"
            f" size where the token pass walks the variant's chunks)"
        )


def check_segments(v: Variant, stage: str, knobs: Knobs | None) -> None:
    """Knob segments (stages chunk.fwd_small, chunk.bwd_dh_small) splits dense sequences only (a varlen batch's
    sequences have their own lengths); SpecError naming the variant otherwise."""
    if knobs is not None and knobs.segments is not None and v.varlen:
        raise SpecError(f"variant {v.name}: tuning chunk.{stage}.segments = {knobs.segments}: dense variants "
                        "only (varlen: false); limit the rule with `when`, e.g. {varlen: [false]}")


# Per target: (predicate on (variant, arch), reason). What one arch cannot hold, refused before compiling.
_TARGET_RULES: list[tuple[Any, Any]] = [
    (lambda v, arch: v.dtype not in arch.dtypes, lambda v, arch: f"{arch.target} has no {v.dtype} support ({arch.name})"),
    (
        # measured (Triton 3.6): 120-121 KB at K = 192/256 with 16-wide V tiles, bounded or any gate
        lambda v, arch: v.op == "chunk" and v.dtype == "fp32" and v.K > 128 and arch.smem_per_block < 124 * 1024,
        lambda v, arch: (
            f"the fp32 chunk backward at K > 128 needs about 120 KB of shared memory even with 16-wide V tiles; "
            f"{arch.target} has {arch.smem_per_block // 1024} KB per block: use bf16/fp16 or K <= 128 there"
        ),
    ),
]


def unit_flags(
    arch: ArchProfile, triton_version: Version, v: Variant, quirks: Any = None
) -> tuple[dict[str, Any], dict[str, Any], list[str], str | None]:
    """quirks.arch_flags for one variant on one arch, plus the runtime's ``needs_allocator`` flag."""
    flags, limits, applied, refusal = quirk_registry.arch_flags(
        arch.cc, triton_version, arch.base_flags(), quirks=quirks, variant=v.params()
    )
    # kernels that may need global scratch get an allocator set before launch (see runtime)
    flags["needs_allocator"] = bool(limits.get("needs_allocator", False))
    return flags, limits, applied, refusal


def unit_for(
    spec: Spec, arch: ArchProfile, triton_version: Version, v: Variant, lenient: bool = False, quirks: Any = None
) -> BuildUnit | Filtered:
    """Variant ``v`` of ``spec`` for one target: its build unit (flags, resolved knobs), or why it is refused.
    ``lenient`` (variants generated on demand, which no one wrote the spec's rules for): a stage-only knob that a
    matching rule sets but this variant cannot take (e.g. the Gluon token pass at K != 64, 128) is dropped
    instead of being a SpecError. ``quirks``: the registry entries to apply (default: all; compat's count of what
    each entry changes)."""
    flags, limits, applied, refusal = unit_flags(arch, triton_version, v, quirks=quirks)
    what = f"{v.name}__{arch.target}"
    unfit = next((why(v, arch) for pred, why in _TARGET_RULES if pred(v, arch)), None)
    if refusal is not None or unfit is not None:
        return Filtered(what, refusal if refusal is not None else unfit)
    tune = _resolve_knobs(spec, arch, v, limits, lenient)
    if v.op == "chunk" and tune["bwd"].gluon and triton_version in GLUON_TRITON:
        # checked only where the Gluon form is built: elsewhere the knob is a no-op, and a quirk of an
        # older release may cap the stage's warps below the Gluon kernel's 4
        try:
            check_gluon(v, tune["bwd"])
            flags["gluon_token_pass"] = True
        except SpecError:
            if not lenient:
                raise
            tune["bwd"] = tune["bwd"].model_copy(update={"gluon": None})
    return BuildUnit(v, arch, flags, tune, tuple(applied))


def build_units(
    spec: Spec, triton_version: Version
) -> tuple[list[BuildUnit], list[Filtered]]:
    """Every (variant, target) to build under ``triton_version``, and the pairs refused with the reason."""
    variants, filtered = expand(spec)
    units: list[BuildUnit] = []
    refused: list[Filtered] = list(filtered)
    for target in spec.targets:
        arch = get_arch(target)
        for v in variants:
            u = unit_for(spec, arch, triton_version, v)
            (units if isinstance(u, BuildUnit) else refused).append(u)  # type: ignore[arg-type]
    return units, refused

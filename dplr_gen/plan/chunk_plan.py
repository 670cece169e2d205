"""The kernel plan of one chunk build unit: its tiles, passes and dtypes, decided once in Python.

The chunk template (dplr_gen/render/templates/chunk_dplr.py.jinja) renders from a ``ChunkPlan`` (its ``plan``)
and decides nothing itself; the driver reads the same values back from the tables the template emits
(CONSTEXPRS, OPTIONS, LAUNCH). Equations: docs/chunk_algorithm.md and docs/math.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..spec.arch import ArchProfile
from ..spec.models import Knobs
from .variant import Variant
from .variants import BuildUnit, factored

# the template's tiles are powers of two; a head dim is padded to the next one (masked)
_POW2 = (16, 32, 64, 128, 256, 512)
# Triton's name of each storage dtype (the `tl` element type) and its signature spelling
_TL = {"bf16": "tl.bfloat16", "fp16": "tl.float16", "fp32": "tl.float32"}
# log2 of each chunk size a variant may have (the product form of (I - A)^-1 squares log2(C) - 1 times)
_LOG2 = {16: 4, 32: 5, 64: 6}


@dataclass(frozen=True)
class ChunkPlan:
    """Every render-time decision of one chunk unit; the template reads these as ``plan.<field>``."""

    # the variant's chunk size C: tokens per chunk of the prep and the state passes
    chunk: int
    # K tile: K padded to a power of two (the prep and the state passes hold all K columns)
    block_k: int
    # V padded to a power of two: the widest V tile any pass takes
    block_v_max: int
    # the knob sets of each kernel: the prep takes chunk.prep (else chunk.fwd's), the reverse pass chunk.bwd_dh
    # (else chunk.bwd's)
    knobs_prep: Knobs
    knobs_fwd: Knobs
    knobs_bwd_dh: Knobs
    knobs_bwd: Knobs
    # optional second knob sets of the state passes, for grids smaller than the device (the driver chooses)
    knobs_fwd_small: Knobs | None
    knobs_bwd_dh_small: Knobs | None
    # the small-grid state passes over at most this many segments of each sequence (knob segments:
    # chunk.fwd_small for the forward's and the states-only pass; dense variants only); 0: no segmented pass
    segments: int
    # the same for the small-grid reverse pass (knob chunk.bwd_dh_small.segments)
    segments_bwd: int
    # the token pass's chunk TC (knob chunk.bwd.chunk, at least C): U and dR are per-token quantities
    # (u_t = a_t^T S_{t-1}, dr_t = b_t^T dS_t), the same for any chunking, so it needs only the state entering
    # each of its chunks and dS at each one's end. The state passes then store every states_stride-th boundary
    # state: that many times fewer h and dh bytes written, read and held at the backward's peak.
    token_chunk: int
    # tokens per slot of the kept states h and dh (knob chunk.bwd.states_every, validated in
    # variants.check_states_every): the token chunk, or twice it
    states_every: int
    # states kept every second token-pass chunk only: the token pass derives the state entering each odd chunk
    # from the kept one (the states pass's step over the chunk before) and dS leaving each even one (the reverse
    # pass's step over the chunk after), with the prep's gate-scaled operands: the short chunks' cheap token pass
    # at the long chunks' h and dh bytes
    derive_states: bool
    # the state passes store every states_stride-th chunk's boundary state (states_every // C)
    states_stride: int
    # V tiles of the state passes, the token pass and the small-grid copies (0: no such copy)
    block_v_fwd: int
    block_v_dh: int
    block_v_bwd: int
    block_v_fwd_small: int
    block_v_dh_small: int
    # log2(C): the steps of the product form of (I - A)^-1
    log2_chunk: int
    # the varlen arguments the sequence/slot helpers take ("": dense)
    cu_args: str
    cu_map_args: str
    # what the Gluon token pass's _locate takes besides the work item: the varlen maps, or the dense length
    locate_args: str
    # a declared gate bound is enforced in every path: gk is clamped to >= bound, so the result never depends on
    # the path
    clamp: bool
    # the caller's lower_bound promise, checked by the bounded variants' preps (runtime/gate_check.py)
    promise_args: str
    # factored exponents (tensor-core A matrices) when the gate is bounded and |exponent| <= TC*|L|/2 stays within
    # FACTOR_LIMIT (variants.factored: one rule for the templates and the spec checks)
    factored: bool
    # any gate: the exponents from the factored form's differences, exact sums only in the chunks that cannot
    # take that form; the prep loads the gates first (knob chunk.prep.lazy_exact_gates)
    lazy_exact_gates: bool
    # any gate: each prep is a factored-form kernel flagging each chunk, then a persistent exact-form kernel for the
    # chunks flagged 0 (knob chunk.prep.split_exact; chunk_kernels' "split_exact" kernels)
    split_exact: bool
    # the small-grid kernels built again for T divisible by 16 (knob divisible_t of chunk.fwd_small and
    # chunk.bwd_dh_small; dense variants): their names, launched instead where T is (runtime: OPTIONS "divisible_t")
    divisible_t: tuple[str, ...]
    # the token pass's K columns per program (knob chunk.bwd.block_k): given the four [C, C] dA matrices, which
    # contract over V only and which each such program forms in full, every other quantity of the pass is per
    # K column
    block_k_bwd: int
    # K > 128, factored: the token pass recomputes the gate-factored tiles after its V loop instead of keeping them
    # (4 x C x BK fp32: 64 KB at chunk 16, K = 256) in shared memory through it
    refactor_after_v_loop: bool
    # the token pass forms its gates and gate-scaled tiles after the V loop, which needs none of them, where its
    # [TC, BK] tiles are small enough for the raw input tiles to stay live through the loop: the loads' latency
    # then hides behind the loop (docs/design.md, token pass); K > 128, factored: after it too, loaded there
    gates_after_v_loop: bool
    # there too, the token pass's cumulative sum of the (bounded, finite) gates as a product with the
    # lower-triangular ones on the CUDA cores (fp32 FMA, exact order; docs/design.md, token pass). Never with
    # unbounded gates: 0 * -inf is NaN.
    token_scan_as_dot: bool
    # the backward's prep writes W after the reverse pass's products where its [C, K] tiles are 128 wide or more
    # (fewer spills there; slower at K = 64; docs/design.md, preps)
    prep_bwd_w_last: bool
    # dtype of the chained dot operands: the input dtype
    dot_dtype: str
    # gate-factored operands (Q e^G, K e^-G, ...) stay in fp32: rounding them once more than the inputs made the
    # bounded path less accurate than fla in bf16/fp16, and fp16 can overflow (docs/design.md, numerics)
    factored_dtype: str
    # input_precision of fp32 dots: the spec's for fp32 variants; tf32 for bf16 (3 more bits than bf16); tf32x3
    # for fp16, whose inputs carry as many bits as tf32 (single tf32 dots doubled fp16 errors; docs/design.md)
    precision: str
    # signature types of the input/output tensors, the chunk-boundary states h and dh, and the gates. h and dh are
    # bf16 for bf16 variants (every dot reads them rounded to bf16 anyway, and it halves the largest memory
    # stream); fp16 and fp32 keep fp32 (range)
    io_type: str
    states_type: str
    gate_type: str
    # the reverse pass runs beside the states pass on a second stream (knob chunk.bwd_dh.overlap)
    overlap_state_passes: bool
    # the small-grid copies are launched below this many programs per SM of the main grid (knob launch_below_sms)
    fwd_small_below_sms: int
    bwd_dh_small_below_sms: int


def _pad_pow2(n: int) -> int:
    return next(p for p in _POW2 if p >= n)


def _block_v(knob: int | None, default: int, widest: int, narrowest: int) -> int:
    """A V tile: the knob's (else the default), at most V padded, at least the narrowest the chunk allows."""
    return max(min(knob or default, widest), narrowest)


def chunk_plan(unit: BuildUnit) -> ChunkPlan:
    """The plan of a chunk build unit."""
    if unit.variant.op != "chunk":
        raise ValueError(f"chunk_plan: unit {unit.name} is a {unit.variant.op!r} unit; only 'chunk' units have a "
                         "chunk plan")
    return plan_chunk(unit.variant, unit.arch, unit.tune)


def plan_chunk(v: Variant, arch: ArchProfile, tune: Mapping[str, Knobs]) -> ChunkPlan:
    """The plan of a chunk variant on a target (its profile ``arch``) from its resolved knobs per stage."""
    C = v.chunk_size
    if C not in _LOG2:
        raise ValueError(f"plan_chunk: variant {v.name}: chunk_size {C!r}; valid: {sorted(_LOG2)}")
    bk = _pad_pow2(v.K)
    bv_max = _pad_pow2(v.V)
    t_fwd, t_bwd = tune["fwd"], tune["bwd"]
    t_prep = tune.get("prep", t_fwd)
    t_dh = tune.get("bwd_dh", t_bwd)
    t_fwd_small, t_dh_small = tune.get("fwd_small"), tune.get("bwd_dh_small")
    tc = max(t_bwd.chunk or C, C)
    hc = max(t_bwd.states_every or tc, tc)
    # chunk 64: V tiles narrower than 64 gave wrong results / illegal accesses on sm_90 (Triton 3.6)
    bv_min = 64 if C >= 64 else 16
    bv_min_bwd = 64 if tc >= 64 else 16
    # the fp32 [BK, BV] state tiles (registers, and their copies in shared memory) stay at 4096 elements: 64 up to
    # K = 64, 32 up to 128, 16 above (at K = 256 and BV 32 the fp32 backward needs 187 KB of shared memory, more
    # than sm_80's 163 KB)
    bv_default = min(bv_max, 64, 4096 // bk)
    # the token pass holds the most tiles at once: under 128 KB of shared memory per block (sm_86, sm_89, sm_120:
    # 99 KB) its V tiles default to 16 (fp32 at K = 128 needs 103-118 KB at 64/32)
    bv_default_bwd = 16 if arch.smem_per_block < 131072 else bv_default
    clamp = v.gate_bound is not None
    is_factored = factored(tc, v.gate_bound)
    bk_bwd = min(t_bwd.block_k or bk, bk)
    refactor = is_factored and bk_bwd > 128
    small_tiles = tc * bk_bwd <= 1024  # H100, Triton 3.6: faster at [16, 64]; [32, 128] spills already
    if v.dtype == "fp32":
        precision = v.dot_precision or "ieee"
    else:
        precision = "tf32x3" if v.dtype == "fp16" else "tf32"
    return ChunkPlan(
        chunk=C,
        block_k=bk,
        block_v_max=bv_max,
        knobs_prep=t_prep,
        knobs_fwd=t_fwd,
        knobs_bwd_dh=t_dh,
        knobs_bwd=t_bwd,
        knobs_fwd_small=t_fwd_small,
        knobs_bwd_dh_small=t_dh_small,
        segments=(t_fwd_small.segments or 0) if t_fwd_small and not v.varlen else 0,
        segments_bwd=(t_dh_small.segments or 0) if t_dh_small and not v.varlen else 0,
        token_chunk=tc,
        states_every=hc,
        derive_states=hc > tc,
        states_stride=hc // C,
        block_v_fwd=_block_v(t_fwd.block_v, bv_default, bv_max, bv_min),
        block_v_dh=_block_v(t_dh.block_v, bv_default, bv_max, bv_min),
        block_v_bwd=_block_v(t_bwd.block_v, bv_default_bwd, bv_max, bv_min_bwd),
        block_v_fwd_small=_block_v(t_fwd_small.block_v, bv_default, bv_max, bv_min) if t_fwd_small else 0,
        block_v_dh_small=_block_v(t_dh_small.block_v, bv_default, bv_max, bv_min) if t_dh_small else 0,
        log2_chunk=_LOG2[C],
        cu_args="cu_seqlens, " if v.varlen else "",
        cu_map_args="cu_seqlens, chunk_map, " if v.varlen else "",
        locate_args="cu_seqlens, chunk_map, " if v.varlen else "T, ",
        lazy_exact_gates=bool(t_prep.lazy_exact_gates) and not is_factored,
        split_exact=bool(t_prep.split_exact) and not is_factored,
        divisible_t=tuple(
            name for knobs, names in ((t_fwd_small, ("chunk_dplr_fwd_small_kernel", "chunk_dplr_fwd_h_small_kernel")),
                                      (t_dh_small, ("chunk_dplr_bwd_dh_small_kernel",)))
            if knobs is not None and knobs.divisible_t and not v.varlen for name in names),
        clamp=clamp,
        promise_args="kept, lower_bound, " if clamp else "",
        factored=is_factored,
        block_k_bwd=bk_bwd,
        refactor_after_v_loop=refactor,
        gates_after_v_loop=small_tiles or refactor,
        token_scan_as_dot=is_factored and small_tiles,
        prep_bwd_w_last=bk >= 128,
        dot_dtype=_TL[v.dtype],
        factored_dtype="tl.float32",
        precision=precision,
        io_type=v.dtype,
        states_type="bf16" if v.dtype == "bf16" else "fp32",
        gate_type=v.gate_dtype,
        overlap_state_passes=bool(t_dh.overlap),
        fwd_small_below_sms=(t_fwd_small.launch_below_sms or 1) if t_fwd_small else 1,
        bwd_dh_small_below_sms=(t_dh_small.launch_below_sms or 1) if t_dh_small else 1,
    )

"""Host side of the chunked DPLR kernels (dplr_gen/render/templates/chunk_dplr.py.jinja): allocations, grids, launches.

No autograd and no validation here: inputs arrive contiguous, in the variant's dtypes. Kernels are launched
through a kernel set ``ks`` (``ks.<kernel>[grid](*runtime_args)``, ``ks.constexprs(<kernel>)``), which adds the
constexpr arguments and launch options of the variant; ``_launch`` passes the run-time arguments by name, in the
order the variant's SIGNATURES declare (dplr_gen/plan/chunk_kernels.py). Nothing here synchronises with the
device.

Chunk slots (where the per-chunk values live): dense, sequence n owns slots n*NT .. n*NT+NT-1
(NT = ceil(T / C)); varlen, the chunk starting at token s of sequence n owns slot s // C + n, which is unique
and below T_total // C + N, so every buffer is sized without reading cu_seqlens on the host. The token pass
may walk longer chunks (TC, its kernel's BC) than the prep and the state passes (C); the chunk-boundary states
h and dh are kept only where its chunks start and end, in slots of TC tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import gate_check
from .devices import cuda_index
from .gate_check import Promise
from .varlen import chunk_map_from_cu_seqlens, slot_map  # noqa: F401 (cp and tests use both from here)

PREP = "chunk_dplr_prep_kernel"
FWD = "chunk_dplr_fwd_kernel"
FWD_H = "chunk_dplr_fwd_h_kernel"
PREP_BWD = "chunk_dplr_prep_bwd_kernel"
BWD_DH = "chunk_dplr_bwd_dh_kernel"
BWD = "chunk_dplr_bwd_kernel"
SEG_MAPS = "chunk_dplr_seg_maps_kernel"
FWD_SEG = "chunk_dplr_fwd_seg_kernel"
FWD_H_SEG = "chunk_dplr_fwd_h_seg_kernel"
SEG_MAPS_BWD = "chunk_dplr_seg_maps_bwd_kernel"
BWD_DH_SEG = "chunk_dplr_bwd_dh_seg_kernel"



@dataclass(frozen=True)
class DriverOptions:
    """Choices tests and benchmarks force on the driver; the defaults leave each to the driver's own rule."""

    # fill every output and scratch buffer with NaN before a launch, so that an element a kernel fails to write
    # shows up
    poison: bool = False
    # force (True) or forbid (False) the state passes' small-grid kernels; None: by the device
    small_grid: bool | None = None
    # force the states pass beside the reverse pass on (True) or off (False) whatever the variant's knob says;
    # None: the knob (and the device, _overlap)
    overlap: bool | None = None
    # force the varlen token pass's launch per sequence on (True, wherever it can run) or off (False); None: by
    # per_sequence_launches' rule
    per_sequence: bool | None = None
    # force the state passes over this many segments per sequence wherever the variant has the segmented passes
    # (0 or 1: one walk); None: by ``segments``' rule
    segments: int | None = None
    # False: every launch skipped (the buffers are allocated and freed as in a real call, never written), for
    # counting memory at any shape without running a kernel (scripts/memory_peak.py)
    launch: bool = True
    # called with each buffer the driver allocates, as it is allocated (scripts/memory_peak.py)
    on_alloc: Callable[[torch.Tensor], None] | None = None


# the options in force: process-wide, not per thread or context (the autograd engine runs a CUDA backward on a
# thread of its own); set with ``forced`` or replaced whole (tests' monkeypatch)
OPTIONS = DriverOptions()


def with_options(**choices: Any) -> DriverOptions:
    """The options in force with ``choices`` (DriverOptions fields) replaced."""
    valid = [f.name for f in dataclasses.fields(DriverOptions)]
    unknown = sorted(set(choices) - set(valid))
    if unknown:
        raise TypeError(f"driver options: unknown {unknown}; valid: {valid}")
    return dataclasses.replace(OPTIONS, **choices)


@contextlib.contextmanager
def forced(**choices: Any) -> Iterator[DriverOptions]:
    """The driver under ``with_options(**choices)`` until the block ends."""
    global OPTIONS
    before = OPTIONS
    OPTIONS = with_options(**choices)
    try:
        yield OPTIONS
    finally:
        OPTIONS = before


# the state passes over segments (knob segments): the fewest chunks a segment walks, and the warps and programs per
# SM its pass may hold. Its cost is about three walks of a segment (the maps' V and K columns, then the pass), so it
# needs at least three segments to gain, and a grid the device runs at once. H100, bf16, forward+backward
# (docs/design.md, segments): (1,32768,32,64), 1-warp passes, 64 programs a one-walk pass: 7.52 ms one walk, 5.52 at
# 4 segments, 5.16 at 8, 5.34 at 16; (2,2048,8,128), 4-warp passes, 64 programs: the kernels of a forward+backward
# 592 us at 4 segments, 721 at 8 (673 one walk).
SEGMENT_MIN_CHUNKS = 16
SEGMENT_WARPS_PER_SM = 8
SEGMENT_PROGRAMS_PER_SM = 4
# The forward's pass has the device to itself (the backward's two passes may share it): where 4 programs an SM
# leave it fewer than three segments, it may hold up to 8. H200, bf16, forward at (4,4096,32,64), 256 programs
# a one-walk pass: 0.598 -> 0.550 ms with 4 segments (any gate 0.678 -> 0.638; 2 segments lose, 0.597), the
# same results bit for bit (docs/design.md, segments).
SEGMENT_PROGRAMS_PER_SM_ALONE = 8


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _empty(shape, dtype, device) -> torch.Tensor:
    if OPTIONS.poison:  # (integers: -1, which no kernel reads as a valid flag or index)
        t = torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    else:
        t = torch.empty(shape, dtype=dtype, device=device)
    if OPTIONS.on_alloc is not None:
        OPTIONS.on_alloc(t)
    return t


# each part of _empty_parts starts at a multiple of this many elements (256 bytes in bf16): the kernels are
# compiled for 16-byte-aligned pointers
_PART_ALIGN = 128


def _empty_parts(shapes: list[tuple[int, ...]], dtype, device) -> list[torch.Tensor]:
    """Tensors of ``shapes`` carved from one allocation, for buffers that live and die together: one allocator
    call instead of one each (~4-10 us of host time each, which the small shapes' forward waits for), and one
    view per part (a split, a slice and a view each cost about as much)."""
    sizes = [_cdiv(math.prod(shape), _PART_ALIGN) * _PART_ALIGN for shape in shapes]
    whole = _empty((sum(sizes),), dtype, device)
    parts, start = [], 0
    for shape, size in zip(shapes, sizes):
        parts.append(whole.as_strided(shape, _contiguous_strides(shape), start))
        start += size
    return parts


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


@functools.lru_cache(maxsize=None)
def _stub(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One element, for the pointer argument of an output a launch never writes (its stores masked off)."""
    return torch.empty((1,), dtype=dtype, device=device)


def boundary_dtype(q: torch.Tensor) -> torch.dtype:
    """dtype of the chunk-boundary states h and dh: bf16 for bf16 variants, else fp32 (see the template)."""
    return torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32


def _layout(C: int, q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[int, int]:
    """(number of sequences N, number of slots of C-token chunks)."""
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is None:
        return B, B * _cdiv(T, C)
    N = cu_seqlens.numel() - 1
    return N, T // C + N


def split_kernel(ks) -> str | None:
    """The second kernel of a token pass split by chunk (any-gate variants with the Gluon token pass): it takes
    the chunks the backward's prep flags 0, the Gluon kernel those it flags 1; None where the pass is one kernel."""
    return ks.option("split_token_pass", None)


def token_chunk(ks) -> int:
    """The token pass's chunk (TC): the variant's chunk size or a multiple of it (knob chunk.bwd.chunk)."""
    return ks.constexprs(BWD)["BC"]


def states_every(ks) -> int:
    """Tokens per slot of the kept chunk-boundary states h and dh (knob chunk.bwd.states_every): the token
    pass's chunk, or twice it where the token pass derives every second state itself."""
    return ks.option("states_every", token_chunk(ks))


def derives_states(ks) -> bool:
    """Whether the token pass derives every second chunk-boundary state (from the backward prep's operands)."""
    return states_every(ks) > token_chunk(ks)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    """SMs of a CUDA device (0 for any other)."""
    if device.type != "cuda":
        return 0
    return _sm_count(cuda_index(device))


def _pass_kernel(ks, name: str, NH: int, V: int, device: torch.device, busy: float = 1.0) -> tuple[str, int]:
    """The state-pass kernel to launch and its V tile: the variant's small-grid copy (``*_small_kernel``,
    where its spec tunes one) when the grid of the first would hold fewer programs than the device's SMs times
    the variant's ``small_grid_below_sms`` for it (knob launch_below_sms; 1 where unset), its programs counted
    at ``busy``, the share of the pass for which a program holds the device on average. The forward's pass,
    alone on the device, counts a varlen grid at the ``occupancy`` of the sequence starts read on the host:
    mixed lengths leave the pass's tail to the longest sequences' programs, which the copy's narrower tiles
    walk faster (H200, bf16, 11 sequences of 512-8192 tokens, H = 32, K = 64: forward 1.30 -> 1.18 ms). The
    backward's passes count every program: there the copy lost what it saved (docs/design.md, varlen
    forward)."""
    small = name.replace("_kernel", "_small_kernel")
    if ks.has(small):
        if OPTIONS.small_grid is not None:
            use = OPTIONS.small_grid
        else:
            below = ks.option("small_grid_below_sms", {}).get(name, 1)
            use = NH * _cdiv(V, ks.constexprs(name)["BV"]) * busy < below * _device_sms(device)
        if use:
            name = small
    return name, ks.constexprs(name)["BV"]


def segments(ks, name: str, programs: int, T: int, device: torch.device, option: str = "segments",
             alone: bool = False) -> tuple[int, int] | None:
    """(segments, chunks per segment) of a dense state pass over segments of each sequence, or None for one
    walk per sequence. Only where the variant has that pass (its OPTIONS ``option``: "segments" for the forward's
    and the states-only pass, knob chunk.fwd_small.segments; "segments_bwd" for the reverse pass, knob
    chunk.bwd_dh_small.segments; at most that many; 0 in every varlen variant; 1 or 2 never reach three, so the
    kernels serve context parallelism only) and the small-grid copy ``name`` was chosen for a grid of
    ``programs``: as many segments as keep the pass's grid within SEGMENT_WARPS_PER_SM warps and
    SEGMENT_PROGRAMS_PER_SM programs per SM (SEGMENT_PROGRAMS_PER_SM_ALONE for a pass that has the device to
    itself, ``alone``, where the first leaves fewer than three), each of at least SEGMENT_MIN_CHUNKS chunks, and
    at least three (DriverOptions.segments forces the count)."""
    most = ks.option(option, 0)
    if not most:
        return None
    NT = _cdiv(T, ks.constexprs(FWD)["BC"])
    if OPTIONS.segments is not None:
        count = OPTIONS.segments
    elif name.endswith("_small_kernel"):
        caps = (SEGMENT_PROGRAMS_PER_SM, SEGMENT_PROGRAMS_PER_SM_ALONE) if alone else (SEGMENT_PROGRAMS_PER_SM,)
        for cap in caps:
            per_sm = max(1, min(cap, SEGMENT_WARPS_PER_SM // ks.warps(name)))
            count = min(most, NT // SEGMENT_MIN_CHUNKS, per_sm * _device_sms(device) // programs)
            if count >= 3:
                break
        else:
            return None
    else:
        return None
    per = _cdiv(NT, max(count, 1))
    n_seg = _cdiv(NT, per)
    return (n_seg, per) if n_seg >= 2 else None


def _launch(ks, name: str, grid: tuple[int, ...], args: dict[str, Any], stream: int | None = None) -> None:
    """Launch kernel ``name`` over ``grid`` with the run-time arguments its SIGNATURES entry declares (names and
    order: dplr_gen/plan/chunk_kernels.py), each taken by name from ``args`` (which may hold more); on the raw
    CUDA stream ``stream`` where given, else the current one."""
    try:
        values = [args[n] for n in ks.arguments(name)]
    except KeyError as e:
        raise TypeError(f"{name}: no value given for its argument {e.args[0]!r}") from None
    twin = ks.option("divisible_t", {}).get(name)  # the same kernel built for T divisible by 16 (knob divisible_t)
    if twin is not None and args["T"] % 16 == 0:
        name = twin
    if OPTIONS.launch:
        if stream is None:
            getattr(ks, name)[grid](*values)
        else:
            getattr(ks, name)[grid](*values, stream=stream)


def _segmented_pass(ks, maps: str, kernel: str, seg: tuple[int, int], NH: int, K: int, V: int,
                    device: torch.device, args: dict[str, Any]) -> torch.Tensor:
    """Launch a state pass over segments (``seg`` from ``segments``): kernel ``maps`` writes each segment's map
    [L | P] (every segment but the one the pass starts from), then ``kernel`` walks every segment from the
    state the maps fold into; each takes its arguments by name from ``args`` and the maps. Returns the maps
    (the caller holds them where the launches went to a side stream)."""
    xs = launch_maps(ks, maps, seg[0] - 1, NH, K, V, device, {**args, "seg_chunks": seg[1]})
    launch_segments(ks, kernel, seg, NH, V, args, xs)
    return xs


def launch_segments(ks, kernel: str, seg: tuple[int, int], NH: int, V: int, args: dict[str, Any],
                    xs: torch.Tensor) -> None:
    """Launch ``kernel``, a state pass over ``seg`` = (segments, chunks per segment) of each of NH (sequence, head)
    pairs, from the maps ``xs`` of every segment but the one it starts from (its other arguments by name from
    ``args``): a program per segment and block of V columns."""
    n_seg, per = seg
    bv = ks.constexprs(kernel)["BV"]
    _launch(ks, kernel, (NH, _cdiv(V, bv), n_seg), {**args, "xs": xs, "seg_chunks": per})


def launch_maps(ks, maps: str, n: int, NH: int, K: int, V: int, device: torch.device, args: dict[str, Any],
                ) -> torch.Tensor:
    """Launch segment-map kernel ``maps`` over ``n`` segments of each of NH (sequence, head) pairs (its other
    arguments by name from ``args``); returns the maps xs [NH, n, K, V + K] fp32: a program per block of L's V
    columns and of P's K columns."""
    bv = ks.constexprs(maps)["BV"]
    xs = _empty((NH, n, K, V + K), torch.float32, device)
    _launch(ks, maps, (NH, _cdiv(V, bv) + _cdiv(K, bv), n), {**args, "xs": xs})
    return xs


def fwd_pass_args(pr: Prep, v_, o, h0, h, ht, u, scale: float, store_states: bool, T: int, H: int,
                  cu_seqlens: torch.Tensor | None = None) -> dict[str, Any]:
    """The forward pass's run-time arguments by name (chunk_dplr_fwd_kernel and its copies), from the forward prep."""
    return {"qw": pr.x3, "kwt": pr.kwt, "v": v_, "bwt": pr.bwt, "egc": pr.egc, "w": pr.w, "m": pr.m,
            "aqk": pr.x1, "aqb": pr.x2, "o": o, "h0": h0, "h": h, "ht": ht, "u": u, **_cu(cu_seqlens),
            "scale": float(scale), "store_states": int(store_states), "T": T, "H": H}


def reverse_pass_args(pr: Prep, do, dht, dh, dh0, dr, dv, scale: float, T: int, H: int,
                      cu_seqlens: torch.Tensor | None = None) -> dict[str, Any]:
    """The reverse pass's run-time arguments by name (chunk_dplr_bwd_dh_kernel, its copies and the gradient maps),
    from the backward prep."""
    return {"qwt": pr.x3, "awt": pr.x4, "egc": pr.egc, "y": pr.x1, "p": pr.x2, "kwt": pr.kwt, "aqkt": pr.x5,
            "aakt": pr.x6, "do": do, "dht": dht, "dh": dh, "dh0": dh0, "dr": dr, "dv": dv, **_cu(cu_seqlens),
            "scale": scale, "T": T, "H": H}


def persistent_launch(ks, name: str, n_items: int, device: torch.device) -> tuple[int, list[int]]:
    """(programs, trailing arguments) of a launch of kernel ``name`` over ``n_items`` work items. A persistent
    kernel (the variant's OPTIONS ``persistent``: each program walks items pid, pid + grid, ... and prefetches the
    next one's tiles) takes n_items as its last argument and gets as many programs as the device holds at once,
    where its loaded binary tells; where it does not (a kernel compiled at run time) as many as its warps allow
    at the most registers a thread may use, not one a work item: on RWKV-7 gates a split pass's second kernel
    has no chunk to take, and 131,072 programs that return at once cost as much as a small kernel. Under the
    interpreter one a work item; any other kernel one program a work item and no argument."""
    if name not in ks.option("persistent", ()):
        return n_items, []
    if device.type != "cuda":
        return n_items, [n_items]
    resident = ks.resident_per_sm(name, device) or ks.resident_floor(name, device)
    return min(n_items, resident * _device_sms(device)), [n_items]


def _launch_persistent(ks, name: str, n_items: int, device: torch.device, args: dict[str, Any],
                       stream: int | None = None) -> None:
    """Launch kernel ``name`` over ``n_items`` work items with the grid (and n_items argument) persistent_launch
    gives it (on the raw CUDA stream ``stream`` where given)."""
    grid, extra = persistent_launch(ks, name, n_items, device)
    _launch(ks, name, (grid,), {**args, **dict(zip(("n_items",), extra))}, stream)


def _cu(cu_seqlens: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The varlen kernel argument of the state passes: cu_seqlens, or nothing for dense inputs."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


def _cu_map(cu_seqlens: torch.Tensor | None, chunk_map: torch.Tensor | None, C: int, n_slots: int,
            ) -> dict[str, torch.Tensor]:
    """The varlen kernel arguments of the chunk-parallel kernels: cu_seqlens and chunk_map (built here unless
    given), or nothing for dense inputs."""
    if cu_seqlens is None:
        return {}
    return {"cu_seqlens": cu_seqlens,
            "chunk_map": chunk_map if chunk_map is not None else slot_map(cu_seqlens, C, n_slots)}


class Prep(NamedTuple):
    """What the chunk-parallel prep writes per chunk slot (input dtype unless noted): W [C, K], M [C, C], the
    gate-scaled state-step operands (B e^(gamma_C - gamma))^T and (K e^(gamma_C - gamma))^T [K, C], e^gamma_C
    [K] (fp32); then for the forward x1 = A_qk, x2 = A_qb [C, C], x3 = Q e^gamma [C, K] (x4 to x6 unused); for
    the reverse pass x1 = Y [C, K], x2 = P [C, C], x3 = (Q e^gamma)^T, x4 = (A e^gamma')^T [K, C], x5 = A_qk^T,
    x6 = A_ak^T [C, C]."""
    w: torch.Tensor | None
    m: torch.Tensor | None
    bwt: torch.Tensor | None
    kwt: torch.Tensor | None
    egc: torch.Tensor
    x1: torch.Tensor
    x2: torch.Tensor
    x3: torch.Tensor
    x4: torch.Tensor | None
    x5: torch.Tensor | None
    x6: torch.Tensor | None
    # the backward's prep run by the forward (``fwd_ops``): the forward pass's view of it (x1 to x3 its own)
    fwd: "Prep | None" = None
    # int32 [slots, H], the backward's prep of a variant whose token pass is split by chunk (split_kernel): 1
    # where the chunk's gates allow the factored form (the Gluon kernel takes it), else 0
    fac: torch.Tensor | None = None


def state_step_operands(pr: Prep) -> tuple[torch.Tensor, ...]:
    """What a token pass that derives every second state reads of the backward prep (in its argument order):
    e^gamma_C, (B e^(gamma_C - gamma))^T, (K e^(gamma_C - gamma))^T (the states pass's step) and (Q e^gamma)^T,
    (A e^gamma')^T (the reverse pass's)."""
    return (pr.egc, pr.bwt, pr.kwt, pr.x3, pr.x4)


def chunk_prep(ks, v, q, k, a, b, gk, cu_seqlens, n_slots: int, for_bwd: bool = False,
               chunk_map: torch.Tensor | None = None, pass_ops: bool = True, fwd_ops: bool = False,
               promise: Promise | None = None) -> Prep:
    """The chunk-parallel, state-independent work (see ``Prep``), for the forward or (``for_bwd``) for the
    backward's passes. ``pass_ops=False`` (backward only, where the forward kept the states): W, M and, unless
    the token pass derives states with it, (B e^..)^T are neither written nor allocated (None in ``Prep``):
    only the states pass reads them. H100, bf16, that prep alone: 1.31 -> 1.18 ms at (8, 4096, 64, 64), 0.343 ->
    0.312 at (4, 4096, 32, 64), 0.338 -> 0.331 at (8, 2048, 16, 128) (docs/design.md, keeping the states).
    ``fwd_ops=True`` (backward's prep with every output, run by a forward that keeps the states for the
    backward): it also writes the forward pass's A_qk, A_qb and Q e^gamma, and ``fwd`` of the result is the
    forward's view of it; one prep then serves both directions (docs/design.md, keeping the states).
    ``promise`` (bounded variants only): the prep clears its flag where a gate breaks the caller's lower_bound
    (gate_check); the caller queues the assert on it (gate_check.confirm). A prep split by chunk (any-gate
    variants, knob chunk.prep.split_exact: the unit's OPTIONS ``split_exact``) is two launches: the factored form
    for every chunk, which flags each one, then the exact form's persistent kernel for those flagged 0."""
    _, T, H, K = q.shape
    C = v.chunk_size
    ck, cc = (n_slots, H, C, K), (n_slots, H, C, C)
    skip_wm = for_bwd and not pass_ops
    if fwd_ops and (skip_wm or not for_bwd):
        raise ValueError("fwd_ops: only the backward's prep with the states pass's operands (pass_ops) writes "
                         "the forward's operands too")
    dt, dev = q.dtype, q.device
    x4 = x5 = x6 = None
    if for_bwd:
        # one allocation per group of outputs that die together (chunk_dplr_bwd): the reverse pass's operands
        # after it, the states pass's after it; e^gamma_C and (K e^..)^T, which both read, on their own, and
        # so the operands a deriving token pass reads later ((Q e^gamma)^T, (A e^gamma')^T, (B e^..)^T)
        derive = derives_states(ks)
        if derive:
            x1, x2, x5, x6 = _empty_parts([ck, cc, cc, cc], dt, dev)
            x3, x4 = _empty(ck, dt, dev), _empty(ck, dt, dev)
        else:
            x1, x2, x3, x4, x5, x6 = _empty_parts([ck, cc, ck, ck, cc, cc], dt, dev)
        if skip_wm:
            w = m = None
            bwt = _empty(ck, dt, dev) if derive else None
        elif derive:
            (w, m), bwt = _empty_parts([ck, cc], dt, dev), _empty(ck, dt, dev)
        else:
            w, m, bwt = _empty_parts([ck, cc, ck], dt, dev)
        kwt = _empty(ck, dt, dev)
    else:  # all read by the forward pass only, so they die together: one allocation
        w, m, bwt, kwt, x1, x2, x3 = _empty_parts([ck, cc, ck, ck, cc, cc, ck], dt, dev)
    egc = _empty((n_slots, H, K), torch.float32, dev)
    fx = tuple(_empty_parts([cc, cc, ck], dt, dev)) if fwd_ops else None  # the forward's: gone after it
    # the skipped outputs' arguments: one valid element for the kernel's masked-off stores
    stub = _stub(q.dtype, q.device) if skip_wm or (for_bwd and not fwd_ops) else None
    w_, m_, bwt_ = (stub if t is None else t for t in (w, m, bwt))
    args = {"q": q, "k": k, "a": a, "b": b, "gk": gk, "w": w_, "m": m_, "bwt": bwt_, "kwt": kwt, "egc": egc,
            **_promise_args(v, promise, q.device), **_cu_map(cu_seqlens, chunk_map, C, n_slots), "T": T, "H": H}
    name = PREP_BWD if for_bwd else PREP
    exact = ks.option("split_exact", {}).get(name)  # the prep split by chunk: its exact form's kernel
    # the per-chunk flags: the split token pass's (Prep.fac), or the exact kernel's only (scratch)
    fac = _empty((n_slots, H), torch.int32, dev) if (for_bwd and split_kernel(ks)) or exact else None
    if for_bwd:
        aqk, aqb, qw = fx or (stub,) * 3
        args.update(y=x1, p=x2, qwt=x3, awt=x4, aqkt=x5, aakt=x6, store_pass_ops=int(not skip_wm), aqk=aqk,
                    aqb=aqb, qw=qw, store_fwd_ops=int(fwd_ops), fac=fac)
    else:
        args.update(aqk=x1, aqb=x2, qw=x3, fac=fac)
    _launch(ks, name, (n_slots * H,), args)
    if exact:
        # the chunks the first kernel flagged 0 (exponents the factored form cannot take), in the exact form
        _launch_persistent(ks, exact, n_slots * H, dev, args)
    fwd = Prep(w, m, bwt, kwt, egc, *fx, None, None, None) if fx else None
    return Prep(w, m, bwt, kwt, egc, x1, x2, x3, x4, x5, x6, fwd, fac if for_bwd else None)


def _promise_args(v, promise: Promise | None, device: torch.device) -> dict[str, Any]:
    """The prep's promise arguments (kept, lower_bound): a bounded variant's prep always takes them (a scratch
    flag and its own bound where nothing is checked), one for any gate none."""
    if v.gate_bound is None:
        if promise is not None:
            raise ValueError(f"promise: variant {v.name} is for any gate, its prep checks no lower_bound")
        return {}
    if promise is None:
        return {"kept": gate_check.scratch_flag(device), "lower_bound": float(v.gate_bound)}
    return {"kept": promise.kept, "lower_bound": promise.lower_bound}


def promise_kept(ks, v, q, k, a, b, gk, lower_bound: float, cu_seqlens: torch.Tensor | None = None,
                 for_fwd_and_bwd: bool = False) -> bool:
    """Whether the forward's prep of bounded variant ``v`` (``for_fwd_and_bwd``: the backward's prep a forward
    that keeps the states runs) finds every gate >= lower_bound, with a fresh flag and no assert (tests)."""
    promise = Promise(float(lower_bound), torch.ones((1,), dtype=torch.int32, device=q.device))
    N, n_slots = _layout(v.chunk_size, q, cu_seqlens)
    chunk_prep(ks, v, q, k, a, b, gk, cu_seqlens, n_slots, for_bwd=for_fwd_and_bwd, fwd_ops=for_fwd_and_bwd,
               promise=promise)
    return bool(promise.kept.item())


def chunk_dplr_fwd(ks, v, q, k, v_, a, b, gk, scale: float, initial_state, cu_seqlens, keep_states: bool = True,
                   prep_for_bwd: bool = False, offsets: list[int] | None = None, promise: Promise | None = None):
    """Returns (o, final_state [N, H, K, V] fp32, saved): the chunk-parallel prep (A matrices,
    (I - A_ab)^-1 and its products), then the sequential state pass, which also writes O and, if
    ``keep_states``, the state entering every token-pass chunk (``h``, see ``states_shape``) and U (as v)
    into ``saved`` for the backward (else ``saved`` holds no states and the backward recomputes them).
    ``prep_for_bwd`` (with ``keep_states``, for a backward to come): the forward runs the backward's prep,
    which writes the forward's operands too, and ``saved["prep"]`` keeps what the backward's passes read of it,
    so the backward runs no prep: one launch and one read of q, k, a, b, gk less, for ~4.8 [B, T, H, K]
    tensors (K = 64; ~5.4 at K = 128, whose deriving token pass also reads (B e^..)^T) held from the forward to
    the backward instead of allocated in it. ``offsets``: cu_seqlens as the caller read it on the host, if it
    did (``slot_map``). ``promise``: checked by the prep (bounded variants; gate_check), then asserted on the
    device."""
    if prep_for_bwd and not keep_states:
        raise ValueError("prep_for_bwd: only a forward that keeps the states (keep_states) runs the backward's prep")
    B, T, H, K = q.shape
    V = v_.shape[-1]
    dev = q.device
    o = _empty((B, T, H, V), v_.dtype, dev)
    if keep_states:
        h = _empty(states_shape(ks, v, q, V, cu_seqlens), boundary_dtype(q), dev)
        u = _empty(v_.shape, v_.dtype, dev)
    else:  # never written (the kernel's stores are masked off): one element each for a valid pointer
        h, u = _stub(boundary_dtype(q), dev), _stub(v_.dtype, dev)
    saved = saved_for_backward(ks, v, q, k, v_, a, b, gk, initial_state, (h, u) if keep_states else None,
                               scale, cu_seqlens, offsets)
    N, n_slots = saved["N"], saved["n_slots"]
    ht = _empty((N, H, K, V), torch.float32, dev)
    if prep_for_bwd:
        full = chunk_prep(ks, v, q, k, a, b, gk, cu_seqlens, n_slots, for_bwd=True, chunk_map=saved["chunk_map"],
                          fwd_ops=True, promise=promise)
        pr = full.fwd
        # what the reverse pass (and a deriving token pass) reads; W, M and the forward's own operands die here
        saved["prep"] = full._replace(w=None, m=None, bwt=full.bwt if derives_states(ks) else None, fwd=None)
    else:
        pr = chunk_prep(ks, v, q, k, a, b, gk, cu_seqlens, n_slots, chunk_map=saved["chunk_map"], promise=promise)
    if promise is not None:
        gate_check.confirm(promise)
    name, bv = _pass_kernel(ks, FWD, N * H, V, dev, occupancy(offsets))
    args = fwd_pass_args(pr, v_, o, initial_state, h, ht, u, scale, keep_states, T, H, cu_seqlens)
    seg = segments(ks, name, N * H * _cdiv(V, bv), T, dev, alone=True)
    if seg is None:
        _launch(ks, name, (N * H, _cdiv(V, bv)), args)
    else:
        _segmented_pass(ks, SEG_MAPS, FWD_SEG, seg, N * H, K, V, dev, args)
    return o, ht, saved


def states_shape(ks, v, q: torch.Tensor, V: int, cu_seqlens: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Shape of the kept chunk-boundary states ``h`` (and ``dh``): [slots of states_every tokens, H, K, V]."""
    return (_layout(states_every(ks), q, cu_seqlens)[1], q.shape[2], q.shape[3], V)


def saved_for_backward(ks, v, q, k, v_, a, b, gk, initial_state, states, scale: float, cu_seqlens,
                       offsets: list[int] | None = None) -> dict:
    """What the backward needs: the inputs, the initial state and ``states`` = (the chunk-start states
    ``h``, U) from the forward, or None: the backward then recomputes them (no O); ``prep``: the backward's
    prep where the forward ran it (``chunk_dplr_fwd``'s prep_for_bwd), else None. Varlen: the slot maps of
    the chunk-parallel kernels (C-token chunks; the token pass's TC-token chunks), from ``slot_map`` (``offsets``:
    cu_seqlens as read on the host, if it was)."""
    C, TC = v.chunk_size, token_chunk(ks)
    N, n_slots = _layout(C, q, cu_seqlens)
    n_tslots = _layout(TC, q, cu_seqlens)[1]
    chunk_map = tchunk_map = None
    if cu_seqlens is not None:
        chunk_map = slot_map(cu_seqlens, C, n_slots, offsets)
        tchunk_map = chunk_map if TC == C else slot_map(cu_seqlens, TC, n_tslots, offsets)
    return {
        "q": q, "k": k, "v": v_, "a": a, "b": b, "gk": gk, "h0": initial_state, "states": states, "prep": None,
        "scale": float(scale), "cu_seqlens": cu_seqlens, "chunk_map": chunk_map, "N": N, "n_slots": n_slots,
        "TC": TC, "tchunk_map": tchunk_map, "n_tslots": n_tslots,
        "n_hslots": _layout(states_every(ks), q, cu_seqlens)[1],
    }


def chunk_states(ks, v, saved, pr: Prep, side: torch.cuda.Stream | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kept chunk-start states ``h`` [slots of states_every tokens, H, K, V] and U again, from the prep's W, M and
    scaled operands (no O), and the tensors the pass touches. ``side``: run the pass on that stream, after the
    current one's work so far; the caller then holds the returned tensors until the current stream has waited
    for ``side`` (their memory, allocated on the current stream, must not be reused before the pass is done).
    That costs no host work, where marking each tensor with ``record_stream`` (the allocator then records and
    polls an event per block) cost 0.07-0.13 ms of host time per backward on the H100 (docs/design.md)."""
    k, v_, h0, cu_seqlens = (saved[n] for n in ("k", "v", "h0", "cu_seqlens"))
    _, T, H, K = k.shape
    V = v_.shape[-1]
    h = _empty((saved["n_hslots"], H, K, V), boundary_dtype(k), k.device)
    ht = _empty((saved["N"], H, K, V), torch.float32, k.device)
    u = _empty(v_.shape, v_.dtype, k.device)
    NH = saved["N"] * H
    name, bv = _pass_kernel(ks, FWD_H, NH, V, k.device)
    args = {"kwt": pr.kwt, "v": v_, "bwt": pr.bwt, "egc": pr.egc, "w": pr.w, "m": pr.m, "h0": h0, "h": h,
            "ht": ht, "u": u, **_cu(cu_seqlens), "T": T, "H": H}
    seg = segments(ks, name, NH * _cdiv(V, bv), T, k.device)

    def launch() -> tuple:
        held = tuple(x for x in args.values() if isinstance(x, torch.Tensor))
        if seg is None:
            _launch(ks, name, (NH, _cdiv(V, bv)), args)
            return held
        return (*held, _segmented_pass(ks, SEG_MAPS, FWD_H_SEG, seg, NH, K, V, k.device, args))

    if side is None:
        return h, u, launch()
    side.wait_stream(torch.cuda.current_stream(k.device))
    with torch.cuda.stream(side):
        held = launch()
    return h, u, held


def chunk_dplr_bwd_dh(ks, v, saved, pr: Prep, do: torch.Tensor, dht: torch.Tensor | None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reverse pass (with the backward prep's Y, P, A_qk^T, A_ak^T and scaled operands): dS at the end of
    every slot of states_every tokens (``dh`` [those slots, H, K, V]), dR (as v), d(initial state) (fp32) and dv."""
    q = saved["q"]
    scale, cu_seqlens, N = saved["scale"], saved["cu_seqlens"], saved["N"]
    _, T, H, K = q.shape
    V = saved["v"].shape[-1]
    dev = q.device
    if dht is None:
        dht = torch.zeros((N, H, K, V), dtype=torch.float32, device=dev)
    dht = dht.to(torch.float32).contiguous()
    dh = _empty((saved["n_hslots"], H, K, V), boundary_dtype(q), dev)
    dh0 = _empty((N, H, K, V), torch.float32, dev)
    dr = _empty(saved["v"].shape, saved["v"].dtype, dev)
    dv = _empty(saved["v"].shape, saved["v"].dtype, dev)
    name, bv = _pass_kernel(ks, BWD_DH, N * H, V, dev)
    args = {**reverse_pass_args(pr, do, dht, dh, dh0, dr, dv, scale, T, H, cu_seqlens), "seg_first": 1}
    seg = segments(ks, name, N * H * _cdiv(V, bv), T, dev, "segments_bwd")
    if seg is None:
        _launch(ks, name, (N * H, _cdiv(V, bv)), args)
    else:  # the maps walk the segments backwards, from dS = 0 with dO and from dS = I without
        _segmented_pass(ks, SEG_MAPS_BWD, BWD_DH_SEG, seg, N * H, K, V, dev, args)
    return dh, dr, dh0, dv


def chunk_dplr_bwd_tokens(ks, v, saved, h: torch.Tensor, u: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
                          dr: torch.Tensor, dk_over_dr: bool = False, dq_over_u: bool = False,
                          steps: tuple[torch.Tensor, ...] = (), fac: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, ...]:
    """The chunk-parallel pass: (dq, dk, da, db, dgk) from the states passes' ``h``, U, ``dh`` and dR; where
    the variant derives every second state (``derives_states``), also from ``steps``, the backward prep's
    operands of the state steps (``state_step_operands``).
    ``dk_over_dr``: dk is written over dR, ``dq_over_u``: dq over U, each where the two have the same shape
    and dtype (K = V; U only where it is this backward's scratch): a [B, T, H, V] buffer less each at the peak
    of the backward.
    Safe: each program reads the dR and U rows of its (chunk, head) in its V loop, before it writes dk and dq
    at the same elements (after the loop), and no other program touches them; not where the variant splits K
    over several programs per chunk (their V loops read every column of those rows) or derives states (its
    programs read their neighbours' rows): no aliasing then.
    ``fac``: the backward prep's per-chunk flags (``Prep.fac``), where the pass is split by chunk
    (``split_kernel``): the Gluon kernel takes the chunks flagged 1, then the split kernel the others (each
    chunk's rows read and written by one program of one launch, so the aliasing above stays safe)."""
    q, k, v_, a, b, gk = (saved[n] for n in ("q", "k", "v", "a", "b", "gk"))
    scale, cu_seqlens, n_tslots = saved["scale"], saved["cu_seqlens"], saved["n_tslots"]
    _, T, H, K = q.shape
    dev = q.device
    nk = _cdiv(K, ks.constexprs(BWD)["BK"])  # programs per (chunk, head), one per block of K columns
    # a program deriving states reads the U rows of the chunk before and the dR rows of the chunk after its own
    alone = nk == 1 and not steps
    dq_over_u, dk_over_dr = dq_over_u and alone, dk_over_dr and alone
    dq = u if dq_over_u and u.shape == q.shape and u.dtype == q.dtype else _empty(q.shape, q.dtype, dev)
    dk = dr if dk_over_dr and dr.shape == k.shape and dr.dtype == k.dtype else _empty(k.shape, k.dtype, dev)
    da = _empty(a.shape, a.dtype, dev)
    db = _empty(b.shape, b.dtype, dev)
    dg = _empty(gk.shape, gk.dtype, dev)
    if len(steps) != (5 if derives_states(ks) else 0):
        raise ValueError(f"steps: {len(steps)} tensors given; this variant's token pass takes "
                         f"{'the 5 of state_step_operands(the backward prep)' if derives_states(ks) else 'none'}")
    split = split_kernel(ks)
    if split and (fac is None or tuple(fac.shape) != (n_tslots, H)):
        raise ValueError(f"fac: this variant's token pass is split by chunk: it takes the backward prep's flags "
                         f"(Prep.fac, int32 [{n_tslots}, {H}]); got {None if fac is None else tuple(fac.shape)}")
    args = {**dict(zip(_TOKEN_INPUTS, (q, k, v_, a, b, gk))), "h": h, "dh": dh,
            **dict(zip(_TOKEN_ROWS, (u, dr, do, dq, dk, da, db, dg))), **dict(zip(_STEP_OPERANDS, steps)),
            **_cu_map(cu_seqlens, saved["tchunk_map"], saved["TC"], n_tslots), "scale": scale, "T": T, "H": H,
            "fac": fac}
    n_items = n_tslots * H * nk
    seqs = per_sequence_launches(ks, saved, nk, dev)
    if seqs is not None:
        _token_pass_per_sequence(saved["twin"], seqs, (q, k, v_, a, b, gk), h, dh, (u, dr, do, dq, dk, da, db, dg),
                                 scale, nk, fac)
    else:
        _launch_persistent(ks, BWD, n_items, dev, {**args, "form": 1})
    if split:
        # the chunks the Gluon kernel left, by the Triton form's persistent programs
        _launch_persistent(ks, split, n_items, dev, {**args, "form": 0})
    return dq, dk, da, db, dg


# the token pass's arguments by group: the inputs, the per-token rows (U, dR, dO, then the outputs) and what a
# deriving pass reads of the backward prep (state_step_operands' order)
_TOKEN_INPUTS = ("q", "k", "v", "a", "b", "gk")
_TOKEN_ROWS = ("u", "dr", "do", "dq", "dk", "da", "db", "dg")
_STEP_OPERANDS = ("egc", "bwt", "kwt", "qwt", "awt")


# The varlen token pass as one launch of the dense twin's kernel per sequence (per_sequence_launches): at most
# this many sequences, each with at least this many waves of work items on the device (a launch costs ~13 us of
# host time and leaves part of the device idle at its end; H100, the bench's 16 sequences: 2336-6368 items, 264
# resident programs; H200, 11 sequences of 512-8192 tokens, the shortest 3.9 waves: forward+backward 4.57 ->
# 4.37 ms with the launch per sequence; docs/design.md, varlen).
PER_SEQUENCE_MAX_SEQS = 64
PER_SEQUENCE_MIN_WAVES = 3


def per_sequence_launches(ks, saved, nk: int, device: torch.device) -> list[tuple[int, int, int]] | None:
    """(first token, end token, first state slot) per sequence where the varlen token pass runs as a launch of
    the dense twin variant's kernel per sequence, on views of that sequence's rows, states and outputs; else
    None. Why: the persistent varlen kernel locates each work item through the slot map, and any location the
    compiler cannot derive from the program id and the arguments costs it 20-25% (docs/design.md, varlen); a
    sequence's own launch has its location in its arguments. Taken where ``saved`` holds the twin's kernel set
    (``twin``, set by the ops where the package has it prebuilt) and the sequence starts as read on the host
    (``offsets``), the twin's token pass walks the same chunks and kept states and derives none, no CUDA graph
    is being captured (a replay would keep this call's launches whatever the lengths then), and, unless
    DriverOptions.per_sequence forces it, the pass is one kernel (not split by chunk), there are few sequences,
    each with PER_SEQUENCE_MIN_WAVES waves of work items on the device (the twin's residency known: a prebuilt
    persistent kernel). In the sequences' order.
    Not for a split pass: its per-sequence launches take only the chunks the prep flags, and the second kernel
    walks every sequence after them anyway (H100, both varlen cases, int64: forward+backward with the launches
    2.79-3.56 ms against 2.71 without them at the 8 ragged sequences, 4.79 against 4.66 at the 11; the unsplit
    bounded variant gains with them at the 11, 4.79 -> 4.60; docs/design.md, varlen)."""
    twin, offs = saved.get("twin"), saved.get("offsets")
    if OPTIONS.per_sequence is False or twin is None or offs is None or saved["cu_seqlens"] is None:
        return None
    TC = saved["TC"]
    if (derives_states(ks) or derives_states(twin) or token_chunk(twin) != TC
            or states_every(twin) != states_every(ks) or bool(split_kernel(twin)) != bool(split_kernel(ks))
            or (device.type == "cuda" and _capturing())):
        return None
    H = saved["q"].shape[2]
    seqs = [(bos, eos, bos // TC + n) for n, (bos, eos) in enumerate(zip(offs[:-1], offs[1:]))]
    if OPTIONS.per_sequence is None:
        resident = twin.resident_per_sm(BWD, device) if device.type == "cuda" else None
        if (split_kernel(ks) or not resident or BWD not in twin.option("persistent", ())
                or len(seqs) > PER_SEQUENCE_MAX_SEQS):
            return None
        wave = resident * _device_sms(device)
        if min(_cdiv(eos - bos, TC) * H * nk for bos, eos, _ in seqs) < PER_SEQUENCE_MIN_WAVES * wave:
            return None
    return seqs


def _token_pass_per_sequence(twin, seqs: list[tuple[int, int, int]], inputs: tuple[torch.Tensor, ...],
                             h: torch.Tensor, dh: torch.Tensor, rows: tuple[torch.Tensor, ...], scale: float,
                             nk: int, fac: torch.Tensor | None = None) -> None:
    """The token pass as a launch of the dense kernel ``twin`` per sequence (per_sequence_launches): its rows of
    ``inputs`` (q, k, v, a, b, gk) and ``rows`` (U, dR, dO, then the outputs dq, dk, da, db, dg), its kept
    states. On CUDA, consecutive sequences alternate between the current stream and the side one (the states
    pass's; a stream of their own, or the longest sequence first, measured no faster: docs/design.md), so that a
    launch's programs start while the last ones of the launch before finish (H100, the bench's 16 sequences:
    1.26 ms with the varlen kernel, 1.19 one stream, 1.08-1.11 two; docs/design.md, varlen); the current stream
    waits for the side one before this returns, and every tensor here was allocated before the fork, so none
    of their memory is handed out again before both streams are done with it. ``fac``: the per-chunk flags of a
    split pass (the twin's Gluon kernel takes the chunks flagged 1; the caller launches the rest)."""
    dev = h.device
    H = inputs[0].shape[2]
    TC = token_chunk(twin)
    side = _side_stream(dev)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(dev))
    # per tensor, (first row, rows) -> its rows from there: [1, T, ...] tensors by token, h, dh and fac by slot
    by_token = {n: _rows_at(t, 1) for n, t in (*zip(_TOKEN_INPUTS, inputs), *zip(_TOKEN_ROWS, rows))}
    by_slot = {"h": _rows_at(h, 0), "dh": _rows_at(dh, 0), "fac": _rows_at(fac, 0)}
    for i, (bos, eos, first) in enumerate(seqs):
        nch = _cdiv(eos - bos, TC)
        args = {**{n: at(bos, eos - bos) for n, at in by_token.items()},
                **{n: at(first, nch) for n, at in by_slot.items()},
                "scale": scale, "T": eos - bos, "H": H, "form": 1}
        _launch_persistent(twin, BWD, nch * H * nk, dev, args,
                           side.cuda_stream if side is not None and i % 2 else None)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)


def _rows_at(t: torch.Tensor | None, dim: int, address: bool | None = None) -> Callable[[int, int], Any]:
    """(first, count) -> rows first..first + count of ``t`` along ``dim`` as a kernel argument: on CUDA
    (``address``, by default where ``t`` is a CUDA tensor) the address the view of them would have (a launcher
    takes an int for a pointer), as a view per tensor and sequence costs ~5 us of host time, 1.0 of the
    backward's 3.6 ms at the bench's 11 sequences (H100 machine, scripts/kernel_profile.py --host-functions);
    elsewhere the view. None stays None."""
    if t is None:
        return lambda first, count: None
    if t.is_cuda if address is None else address:
        base, step = t.data_ptr(), t.stride(dim) * t.element_size()
        return lambda first, count: base + first * step
    return lambda first, count: t.narrow(dim, first, count)


def chunk_dplr_bwd(ks, v, saved, do, dht):
    """Returns (dq, dk, dv, da, db, dgk, dh0): gradients in the input dtypes, dgk in the gate dtype, dh0 fp32.
    Launches: the backward prep (unless the forward ran it: ``saved['prep']``); the reverse pass (which also
    writes dv); the states pass if ``saved`` has no states (beside the reverse pass where ``_overlap`` says so);
    the token pass."""
    do = do.contiguous()
    q, k, a, b, gk = (saved[n] for n in ("q", "k", "a", "b", "gk"))
    recomputed = saved["states"] is None  # else h and U are the forward's, saved by autograd: read only
    # the forward's run of this prep, if it made one: taken out of ``saved``, so that it is freed with ``pr``
    pr = saved.pop("prep", None)
    if pr is None or recomputed:
        pr = chunk_prep(ks, v, q, k, a, b, gk, saved["cu_seqlens"], saved["n_slots"], for_bwd=True,
                        chunk_map=saved["chunk_map"], pass_ops=recomputed)
    # the token pass may read the state steps' operands (and its split's flags): kept until it has run, the rest
    # freed before it
    steps = state_step_operands(pr) if derives_states(ks) else ()
    fac = pr.fac
    if recomputed and _overlap(ks, q, saved["N"], saved["v"].shape[-1], saved.get("offsets")):
        h, u, dh, dr, dh0, dv = _states_beside_reverse_pass(ks, v, saved, pr, do, dht)
    else:
        # the reverse pass first: the prep's reverse-pass operands (Y, P and the scaled operands, 3.75X at
        # K = V = 64, X = one [B, T, H, K] tensor) are freed before the states pass allocates h and U, and only
        # the states pass's (W, M, (B e^..)^T, 2.25X) live beside dh (docs/design.md, buffers reused)
        dh, dr, dh0, dv = chunk_dplr_bwd_dh(ks, v, saved, pr, do, dht)
        pr = pr._replace(x1=None, x2=None, x3=None, x4=None, x5=None, x6=None)
        h, u = chunk_states(ks, v, saved, pr)[:2] if recomputed else saved["states"]
    del pr
    dq, dk, da, db, dg = chunk_dplr_bwd_tokens(ks, v, saved, h, u, do, dh, dr, dk_over_dr=True,
                                               dq_over_u=recomputed, steps=steps, fac=fac)
    return dq, dk, dv, da, db, dg, dh0


def _overlap(ks, q: torch.Tensor, N: int, V: int, offsets: list[int] | None = None) -> bool:
    """Whether the states pass runs beside the reverse pass: where the variant's knob (bwd_dh.overlap) says so
    and both grids fit on the device at once (CUDA tensors only). Where they would not, each pass already
    fills the device and running them together only makes them contend (H100, bf16, fwd+bwd off -> on: 3.34 ->
    3.10 ms at (4,4096,32,64), 256 programs a pass; 10.99 -> 11.57 at (8,4096,64,64), 1024; docs/design.md).
    Varlen with the sequence starts read on the host (``offsets``): a pass lasts as long as its longest
    sequence's walk, and a shorter sequence's programs hold their room for part of it only, so each grid counts
    at the mean over the longest length (``occupancy``): mixed lengths leave the device idle for most of
    the pass, which the other pass fills.
    Never while a CUDA graph is being captured (torch.cuda.graphs, torch.compile's reduce-overhead): a captured
    backward keeps one stream, the form gpu_check's 'graph' job checks (a side stream inside a capture and its
    memory's lifetime across replays are not checked). DriverOptions.overlap forces it either way, on the CPU
    too, where the states pass then runs before the reverse pass on the one stream with the same buffers alive
    (the order whose memory scripts/memory_peak.py counts, and whose results tests compare)."""
    if q.is_cuda and _capturing():
        return False
    if OPTIONS.overlap is not None:
        return OPTIONS.overlap
    if not q.is_cuda or not ks.option("overlap_state_passes", False):
        return False
    if q.shape[0] * q.shape[1] * q.shape[2] < OVERLAP_MIN_TOKEN_HEADS:
        return False
    H = q.shape[2]
    busy = occupancy(offsets)
    grids = []
    for stage in (FWD_H, BWD_DH):
        name, bv = _pass_kernel(ks, stage, N * H, V, q.device)
        grids.append((N * H * _cdiv(V, bv) * busy, ks.resident_per_sm(name, q.device)))
    return grids_fit(grids, _device_sms(q.device))


def occupancy(offsets: list[int] | None) -> float:
    """The share of a state pass's span for which its programs hold the device, on average: mean over longest
    sequence length (1 for equal lengths, dense inputs, or starts not read on the host)."""
    if not offsets or len(offsets) < 2:
        return 1.0
    lengths = [e - b for b, e in zip(offsets[:-1], offsets[1:])]
    longest = max(lengths)
    return sum(lengths) / (len(lengths) * longest) if longest else 1.0


# Below this many token-heads (B * T * H) a training step is bound by host work, not the GPU, and the side stream's
# host cost (a fork and a join, ~0.2 ms a backward) outweighs what the overlap saves on the GPU (H100, bf16,
# host-profiled: off / on 1.17 / 1.32 ms at (1,4096,2,128), 8192 token-heads; 1.11 / 1.28 at
# (2,2048,8,128), 32768; 2.98 / 2.72 at (4,4096,32,64), 524288; 2.15 / 1.85 at (2,4096,32,64), 262144 in
# forced-setting timings; docs/design.md, states pass beside the reverse pass).
OVERLAP_MIN_TOKEN_HEADS = 131072


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def grids_fit(grids: list[tuple[float, int | None]], sms: int) -> bool:
    """Whether grids of (programs, resident programs per SM) are all resident at once on ``sms`` SMs (each
    grid's programs take programs / per-SM of an SM's room; unknown residency: no)."""
    if any(not per_sm for _, per_sm in grids):
        return False
    return sum(n / per_sm for n, per_sm in grids) <= sms


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream beside the current one on a CUDA device (the states pass's and the per-sequence launches');
    None elsewhere (the CPU runs the same launches one after the other, in the order they are issued)."""
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


def _states_beside_reverse_pass(ks, v, saved, pr: Prep, do: torch.Tensor, dht: torch.Tensor | None):
    """(h, u, dh, dr, dh0, dv): the states pass on a side stream while the reverse pass runs on the current one.
    Neither reads the other's outputs (both read the prep's and the inputs), and each is a few hundred
    sequential programs, too few to fill the device alone. The current stream waits for the side one before
    the token pass."""
    dev = saved["q"].device
    side = _side_stream(dev)
    h, u, held = chunk_states(ks, v, saved, pr, side=side)
    dh, dr, dh0, dv = chunk_dplr_bwd_dh(ks, v, saved, pr, do, dht)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    del held  # only now: every later use of their memory on the current stream follows the side stream's pass
    return h, u, dh, dr, dh0, dv

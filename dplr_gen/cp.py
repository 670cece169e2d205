"""Context parallelism: one packed batch of sequences split over the ranks of a torch.distributed group.

Call pattern (fla-core's): ``ctx = build_cp_context(cu_seqlens, group)`` with the global sequence boundaries of a
packed batch (B = 1); rank r holds tokens [r T_local, (r + 1) T_local) of it, T_local = T_global / world_size, and
calls ``chunk_rwkv7(..., cp_context=ctx)`` / ``chunk_dplr_delta_rule(..., cp_context=ctx)`` on its [1, T_local, H, K]
tensors (no ``cu_seqlens``: the context holds the rank's own).

How (docs/math.md): a rank's slice of a sequence maps the state entering it affinely to the state leaving it,
S_out = P S_in + L. Forward: each rank writes the summary [L | P] ([H, K, V + K] fp32) of the sequence leaving it
(the sequence's final state here and P = 0 where that sequence starts on this rank, so that the fold restarts there
with its initial state), one all_gather, then each rank folds its predecessors' summaries into the state entering
its first sequence and runs the op on its slice. Backward mirrors it: each rank computes the gradient reaching the
state entering its slice from its own outputs alone (dS_out = 0), one all_gather, and folds its successors' into
the gradient reaching the state leaving its slice (dS_out = P^T dS_out' + G), then runs its backward with it. Each
rank's backward thus sees the true entering state and the true gradient of its leaving state, so every gradient
is the single-process op's (the summaries only carry values between ranks; they need no gradient of their own).

Schedule, per rank (both exchanges start asynchronously; a rank queues what needs no other rank's values before it
waits): forward, the map of the sequence leaving the slice (its prep and every segment's map, folded in fp32; from
its own initial state where it starts here) and the entering sequence's prep and maps; the exchange starts; the
sequences inside the slice and the leaving sequence's pass; once the summaries are in, the entering sequence's pass
from the folded state. Backward, the gradient reaching the entering state (the backward prep, the states pass, and
every segment's gradient map, the first's included, folded) and the leaving sequence's prep, states and maps; the
exchange starts; the sequences inside and the rest of the entering sequence's backward; once the gradients are
in, the leaving sequence's reverse and token passes. (An exchange started earlier cost more: the collective's
kernel holds SMs from its launch until every rank has joined.) An exchange thus waits on another rank only for its
state-independent work and small fp32 folds: beyond the one-GPU op, the critical path holds the maps of the last
segment and of the first segment's gradient, the folds, and two all_gathers. Where the op's rule walks a slice in
one segment, its map takes a walk of its own (the leaving sequence then just walks from its initial state).
Requires the segment-map kernels in the dense variant of the inputs' dtype and head sizes (knobs
chunk.fwd_small.segments and chunk.bwd_dh_small.segments; every shipped spec builds them for each dense variant,
not for variants generated on demand). Bytes: each rank sends H K (V + K) 4 bytes in the forward and H K V 4 in
the backward (plus a 96-byte descriptor per forward, host to host) and receives world_size - 1 times that; for
H = 32, K = V = 64: 1 MiB + 0.5 MiB sent per call.

What each rank returns: o for its own tokens; with ``output_final_state`` a [N_global, H, K, V] fp32 tensor holding
the final states of the sequences that end on this rank and zeros elsewhere (summing it over the ranks, e.g.
``torch.distributed.all_reduce``, gives every sequence's final state; each sequence ends on exactly one rank). The
gradient of ``initial_state`` ([N_global, H, K, V], the same on every rank) holds the entries of the sequences that
start on this rank and zeros elsewhere: sum it over the ranks (as data-parallel gradient reduction does) for the
total. Every rank must run every call and backpropagate through it (the backward holds a collective).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from .runtime import chunk_api as api
from .runtime import chunk_driver as cd
from .runtime import gate_check

if TYPE_CHECKING:
    from .runtime.loader import SpecPackage


@dataclasses.dataclass(frozen=True, eq=False)
class CPContext:
    """One rank's view of a packed batch split over ``group`` (from build_cp_context). ``cu_seqlens`` /
    ``cu_seqlens_cpu``: the rank's own sequence boundaries (int64, local token indices); ``pieces``: per local
    sequence (global sequence index, first local token, end local token); ``enters`` / ``leaves``: per rank, whether
    a sequence crosses its left / right boundary; ``first_rank`` / ``last_rank``: per rank, where the sequence
    crossing its left / right boundary starts / ends."""

    group: Any
    rank: int
    world_size: int
    offsets: tuple[int, ...]
    T_local: int
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    pieces: tuple[tuple[int, int, int], ...]
    enters: tuple[bool, ...]
    leaves: tuple[bool, ...]
    first_rank: tuple[int, ...]
    last_rank: tuple[int, ...]
    key: int
    host_group: Any = None  # the group the per-call descriptors go through (host tensors): see _host_group

    # fla-core's FLACPContext fields, for callers that read them
    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def pre_num_ranks(self) -> int:
        """Ranks before this one that the sequence entering it spans (0 if none enters)."""
        return self.rank - self.first_rank[self.rank] if self.enters[self.rank] else 0

    @property
    def post_num_ranks(self) -> int:
        """Ranks after this one that the sequence leaving it spans (0 if none leaves)."""
        return self.last_rank[self.rank] - self.rank if self.leaves[self.rank] else 0

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    def run(self, names: tuple[str, ...], package: "SpecPackage", tensors: tuple[torch.Tensor, ...], scale: Any,
            initial_state: Any, output_final_state: bool, cu_seqlens: Any, cu_seqlens_cpu: Any,
            chunk_size: Optional[int], lower_bound: Optional[float]
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The chunk op on this rank's slice: what the op calls for ``cp_context=self``. The context carries it
        so that the op (runtime layer) reaches context parallelism without importing this module."""
        return run(names, package, tensors, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                   chunk_size, lower_bound, self)


def build_cp_context(cu_seqlens: torch.Tensor, group: Any = None, conv1d_kernel_size: Optional[int] = None,
                     cu_seqlens_cpu: Optional[torch.Tensor] = None) -> CPContext:
    """The context of this rank for a packed batch with global boundaries ``cu_seqlens`` (int32/int64 [N + 1], from
    0 to T_global) split over ``group`` (default: the world): rank r holds tokens [r T_local, (r + 1) T_local),
    T_local = T_global / world_size. ``cu_seqlens_cpu``: the same values on the host, if the caller has them (saves
    a device read). The arguments are fla-core's, in its order; its ``conv1d_kernel_size`` is accepted and ignored
    (no convolution here). Every rank of the group calls it: the first context built for a group whose backend
    takes no host tensors (NCCL) also makes a gloo group over its ranks, for the per-call checks."""
    if conv1d_kernel_size is not None and (isinstance(conv1d_kernel_size, bool)
                                           or not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1):
        hint = (": pass cu_seqlens_cpu by keyword (the third positional argument is fla-core's conv1d_kernel_size)"
                if isinstance(conv1d_kernel_size, torch.Tensor) else "")
        raise TypeError(f"conv1d_kernel_size must be None or a positive int, got "
                        f"{type(conv1d_kernel_size).__name__}{hint}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_cp_context needs torch.distributed initialised (dist.init_process_group) first")
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    world = dist.get_world_size(group)
    src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    for name, t in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", src)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 or int64 tensor of global sequence boundaries, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    offsets = tuple(int(x) for x in src.tolist())
    if len(offsets) < 2 or offsets[0] != 0:
        raise ValueError(f"cu_seqlens must be [0, ..., T_global] with at least 2 entries, got {list(offsets[:4])}...")
    if any(y <= x for x, y in zip(offsets, offsets[1:])):
        raise ValueError("cu_seqlens must be strictly increasing (every sequence needs a token)")
    if cu_seqlens_cpu is not None and cu_seqlens.numel() != len(offsets):
        raise ValueError(f"cu_seqlens_cpu has {len(offsets)} entries but cu_seqlens {cu_seqlens.numel()}")
    total = offsets[-1]
    if total % world:
        raise ValueError(f"cu_seqlens total T_global = {total} is not a multiple of the group's world_size = {world} "
                         "(every rank holds T_global / world_size tokens)")
    T = total // world
    bounds = set(offsets)
    enters = tuple(r > 0 and r * T not in bounds for r in range(world))
    leaves = tuple(r < world - 1 and (r + 1) * T not in bounds for r in range(world))
    first_rank, last_rank = [], []
    for r in range(world):
        f = r
        while enters[f]:
            f -= 1
        first_rank.append(f)
        e = r
        while leaves[e]:
            e += 1
        last_rank.append(e)
    lo, hi = rank * T, (rank + 1) * T
    pieces = tuple((n, max(s, lo) - lo, min(e, hi) - lo) for n, (s, e) in enumerate(zip(offsets, offsets[1:]))
                   if s < hi and e > lo)
    local = [0, *(p[2] for p in pieces)]
    digest = hashlib.blake2b(struct.pack(f"<{len(offsets) + 1}q", world, *offsets), digest_size=7).digest()
    return CPContext(
        group=group, rank=rank, world_size=world, offsets=offsets, T_local=T,
        cu_seqlens=torch.tensor(local, dtype=torch.int64, device=cu_seqlens.device),
        cu_seqlens_cpu=torch.tensor(local, dtype=torch.int64), pieces=pieces, enters=enters, leaves=leaves,
        first_rank=tuple(first_rank), last_rank=tuple(last_rank), key=int.from_bytes(digest, "little"),
        host_group=_host_group(group) if world > 1 else group,
    )


# the gloo twin of each group whose backend takes no host tensors, made once: (the group, its twin)
_HOST_GROUPS: dict[int, tuple[Any, Any]] = {}


def _host_group(group: Any) -> Any:
    """A group over ``group``'s ranks that exchanges host tensors: ``group`` itself where its backend does (gloo),
    else a gloo group over the same ranks, made on the first context built for ``group`` (only its members take
    part). The per-call descriptors go through it, so checking that the ranks agree never waits for the device:
    over NCCL the descriptors would sit on the GPU, and reading them back would make the host wait for all the
    work queued before the call."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    held = _HOST_GROUPS.get(id(group))
    if held is None or held[0] is not group:
        ranks = dist.get_process_group_ranks(group)
        held = _HOST_GROUPS[id(group)] = (group, dist.new_group(ranks=ranks, backend="gloo",
                                                                  use_local_synchronization=True))
    return held[1]


# ----------------------------------------------------------------------------------------------------------------
# the exchange


class _Gather:
    """An all_gather under way; ``result()`` waits for it and returns [world_size, *x.shape]. Started before the
    rank queues the work that needs no other rank's values, so that this work runs while the exchange waits for
    slower ranks (on the GPU the wait only orders the current stream after the collective)."""

    def __init__(self, x: torch.Tensor, ctx: CPContext, group: Any = None) -> None:
        self.x: Optional[torch.Tensor] = x.contiguous()  # held until the collective is done
        self.out = [torch.empty_like(x) for _ in range(ctx.world_size)]
        self.work: Any = dist.all_gather(self.out, self.x, group=ctx.group if group is None else group,
                                         async_op=True)

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            # the finished collective's handle (and the input) let go at once: a gloo handle that holds tensors
            # when the interpreter shuts down (kept alive by whatever still holds this object) aborts the process
            self.work = self.x = None
        return torch.stack(self.out)


def _all_gather(x: torch.Tensor, ctx: CPContext, group: Any = None) -> _Gather:
    """Start gathering every rank's x (the same shape and dtype on every rank) over ``group`` (default: the
    context's)."""
    return _Gather(x, ctx, group)


_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_FIELDS = ("context (cu_seqlens and world_size)", "rank in the group", "world_size", "H", "K", "V", "dtype of q/k/v/a/b",
           "dtype of gk", "T_local", "scale")


def _start_agreement(ctx: CPContext, info: Optional[dict[str, Any]], err: Optional[Exception]
                     ) -> Callable[[], None]:
    """Starts one all_gather of a fixed-size descriptor of every rank's call (and whether its own checks passed);
    returns ``confirm``, which waits for it and raises where the ranks' calls disagree or one's arguments were
    refused: every rank then fails with a message instead of exchanging mismatched summaries or waiting for a rank
    that left. Host tensors over the context's host group: no rank waits for its device. A call confirms just
    before its first exchange of values, so the ranks meet on the host while their own first work runs."""
    mine = [0] * len(_FIELDS)
    if info is not None:
        mine = [ctx.key, ctx.rank, ctx.world_size, info["H"], info["K"], info["V"], _DTYPE_CODES[info["dtype"]],
                _DTYPE_CODES[info["gate_dtype"]], info["T"], struct.unpack("<q", struct.pack("<d", info["scale"]))[0]]
    mine += [int(info is not None), int(err is None)]
    pending = _all_gather(torch.tensor(mine, dtype=torch.int64), ctx, ctx.host_group)
    return functools.partial(_confirm_agreement, pending, err)


def _confirm_agreement(pending: _Gather, err: Optional[Exception]) -> None:
    rows = pending.result().tolist()
    # a disagreement first (a refusal on one rank may follow from it), among the ranks whose calls were checked
    checked = [(r, row) for r, row in enumerate(rows) if row[-2]]
    for i, name in enumerate(_FIELDS):
        if i == 1:
            bad = [r for r, row in checked if row[1] != r]
            if bad:
                raise ValueError(f"cp_context: ranks {bad} of the group called with a context built for another group "
                                 "(its rank does not match the caller's place in this group)")
            continue
        vals = [row[i] for _, row in checked]
        if len(set(vals)) > 1:
            shown = vals if i != 9 else [struct.unpack("<d", struct.pack("<q", x))[0] for x in vals]
            raise ValueError(f"context parallelism: the ranks disagree on {name}: {shown} (ranks "
                             f"{[r for r, _ in checked]}); every rank must call the op with the same context and head "
                             "sizes, dtypes and scale")
    if err is not None:
        raise err
    failed = [r for r, row in enumerate(rows) if not row[-1]]
    if failed:
        raise ValueError(f"context parallelism: rank(s) {failed} of the group refused their arguments (their error "
                         "says why); this rank's were valid")


def _fold_forward(summaries: torch.Tensor, ctx: CPContext, V: int) -> torch.Tensor:
    """The state [H, K, V] fp32 entering this rank's first sequence, from every rank's summary [L | P]: the fold
    starts at the rank where that sequence starts (whose summary is its state there, P = 0)."""
    r = ctx.rank
    first = ctx.first_rank[r]
    S = summaries[first, :, :, :V]
    for j in range(first + 1, r):
        S = summaries[j, :, :, V:] @ S + summaries[j, :, :, :V]
    return S


def _fold_backward(grads: torch.Tensor, summaries: torch.Tensor, ctx: CPContext, V: int) -> torch.Tensor:
    """The gradient [H, K, V] fp32 reaching the state leaving this rank's last sequence, from every rank's gradient
    reaching the state entering its slice from its own outputs (``grads``) and the forward's maps P."""
    r = ctx.rank
    last = ctx.last_rank[r]
    dS = grads[last]
    for j in range(last - 1, r, -1):
        dS = summaries[j, :, :, V:].transpose(-1, -2) @ dS + grads[j]
    return dS


# ----------------------------------------------------------------------------------------------------------------
# the crossing sequences: their maps from the segmented state passes' kernels


def _plan(ks: Any, T: int, H: int, V: int, device: torch.device, option: str) -> tuple[int, int]:
    """(segments, chunks per segment): the op's own split of this walk (chunk_driver.segments), or one segment."""
    name = cd.FWD if option == "segments" else cd.BWD_DH
    small, bv = cd._pass_kernel(ks, name, H, V, device)
    seg = cd.segments(ks, small, H * cd._cdiv(V, bv), T, device, option)
    NT = cd._cdiv(T, ks.constexprs(cd.FWD)["BC"])
    return seg if seg is not None else (1, NT)


def _need_maps(ks: Any, var: Any) -> None:
    """The kernels the crossing sequences' maps take, or an error naming what to build."""
    missing = [n for n in (cd.SEG_MAPS, cd.SEG_MAPS_BWD, cd.FWD_SEG, cd.BWD_DH_SEG) if not ks.has(n)]
    if missing:
        raise ValueError(
            f"context parallelism: a sequence crosses this rank's boundary, which needs the segment-map kernels of "
            f"dense variant {var.name} (missing: {', '.join(missing)}). A spec gives a dense variant these with the "
            "tuning chunk.fwd_small: {segments: N} and chunk.bwd_dh_small: {segments: N}; every shipped spec does "
            "for its own head sizes, and variants generated on demand for other head sizes have none: add the head "
            "sizes to the spec's variants (or that tuning to their group) and rebuild")


def _compose(xs: torch.Tensor, V: int) -> torch.Tensor:
    """The map [L | P] [H, K, V + K] of consecutive segments with maps xs [H, n, K, V + K] (walking order): each
    segment's P times the map so far, plus its L in the first V columns."""
    total = xs[:, 0]
    for j in range(1, xs.shape[1]):
        nxt = xs[:, j, :, V:] @ total
        nxt[..., :V] += xs[:, j, :, :V]
        total = nxt
    return total


def _through_reverse(xs: torch.Tensor, dS: torch.Tensor, V: int) -> torch.Tensor:
    """dS [H, K, V] carried backwards through segments whose gradient maps are xs [H, n, K, V + K] (sequence
    order): the gradient reaching the first segment's start."""
    for j in range(xs.shape[1] - 1, -1, -1):
        dS = torch.baddbmm(xs[:, j, :, :V], xs[:, j, :, V:], dS)
    return dS


class _Piece:
    """The rows of one sequence that crosses a boundary of this rank (its dense variant), run in two halves around
    each exchange. Forward: ``maps`` (the prep and the segments' maps: no state needed) before, ``walk`` (the
    segmented pass from the entering state) after. Backward: ``grad_maps`` (the backward prep, the states pass,
    the segments' gradient maps and, where asked, the gradient reaching the piece's start from its own outputs)
    before, ``grad_walk`` (the reverse pass from the gradient reaching its end, then the token pass) after. So an
    exchange waits on another rank only for that rank's state-independent work and a few fp32 folds."""

    def __init__(self, ks: Any, var: Any, x: tuple[torch.Tensor, ...], scale: float) -> None:
        self.ks, self.var, self.x, self.scale = ks, var, x, scale
        _, self.T, self.H, self.K = x[0].shape
        self.V = x[2].shape[-1]
        self.dev = x[0].device

    def segments(self, option: str = "segments") -> int:
        return _plan(self.ks, self.T, self.H, self.V, self.dev, option)[0]

    # the forward

    def maps(self, total: bool, promise: Any = None) -> Optional[torch.Tensor]:
        """The forward prep (checking ``promise``, gate_check's) and the maps the pass folds its segments'
        entering states from; with ``total`` every segment's, and returns the piece's map [L | P] [H, K, V + K]
        fp32."""
        q, k, v, a, b, g = self.x
        self.pr = cd.chunk_prep(self.ks, self.var, q, k, a, b, g, None, cd._cdiv(self.T, self.var.chunk_size),
                                promise=promise)
        self.seg = _plan(self.ks, self.T, self.H, self.V, self.dev, "segments")
        n = self.seg[0] if total else self.seg[0] - 1
        self.xs = None
        if n:
            pr = self.pr
            self.xs = cd.launch_maps(self.ks, cd.SEG_MAPS, n, self.H, self.K, self.V, self.dev, {
                "kwt": pr.kwt, "v": v, "bwt": pr.bwt, "egc": pr.egc, "w": pr.w, "m": pr.m, "seg_chunks": self.seg[1],
                "T": self.T, "H": self.H})
        return _compose(self.xs, self.V) if total else None

    def walk(self, h0: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Writes o [1, T, H, V] (contiguous) from the state ``h0`` [1, H, K, V] fp32 entering the piece; returns the
        final state [1, H, K, V] fp32."""
        q, k, v, a, b, g = self.x
        H, V, pr = self.H, self.V, self.pr
        ht = cd._empty((1, H, self.K, V), torch.float32, self.dev)
        h, u = cd._stub(cd.boundary_dtype(q), self.dev), cd._stub(v.dtype, self.dev)  # no states kept: recomputed
        args = cd.fwd_pass_args(pr, v, o, h0, h, ht, u, self.scale, False, self.T, H)
        n = self.seg[0]
        if n == 1:
            name, bv = cd._pass_kernel(self.ks, cd.FWD, H, V, self.dev)
            cd._launch(self.ks, name, (H, cd._cdiv(V, bv)), args)
        else:
            cd.launch_segments(self.ks, cd.FWD_SEG, self.seg, H, V, args, self.xs[:, :n - 1].contiguous())
        self.pr = self.xs = None
        return ht

    # the backward

    def grad_maps(self, h0: torch.Tensor, do: torch.Tensor, d_end: Optional[torch.Tensor], start: bool
                  ) -> Optional[torch.Tensor]:
        """The backward's work before the exchange, from the state ``h0`` [1, H, K, V] entering the piece and its
        rows' dO. With ``start``, returns the gradient [H, K, V] fp32 reaching the piece's start from its outputs
        and ``d_end`` [1, H, K, V] (the gradient reaching its end; None: zero, the rest arrives with the exchange
        and is carried by the forward's maps)."""
        ks, var = self.ks, self.var
        q, k, v, a, b, g = self.x
        self.do = do.contiguous()
        self.saved = cd.saved_for_backward(ks, var, q, k, v, a, b, g, h0, None, self.scale, None)
        self.pr = cd.chunk_prep(ks, var, q, k, a, b, g, None, self.saved["n_slots"], for_bwd=True)
        # the states pass beside the maps and the reverse pass, where the op runs it so
        self.side = cd._side_stream(self.dev) if cd._overlap(ks, q, 1, self.V) else None
        self.h, self.u, self.held = cd.chunk_states(ks, var, self.saved, self.pr, side=self.side)
        self.seg = _plan(ks, self.T, self.H, self.V, self.dev, "segments_bwd")
        n, per = self.seg
        self.xs = self.done = None
        if start and n == 1 and d_end is not None:  # the reverse pass itself ends in that gradient
            self.done = self._reverse(d_end)
            return self.done[2][0]
        first = 0 if start else 1  # the pass needs every segment's map but the first's
        if n - first:
            pr = self.pr
            xs = cd.launch_maps(ks, cd.SEG_MAPS_BWD, n - first, self.H, self.K, self.V, self.dev, {
                "qwt": pr.x3, "awt": pr.x4, "egc": pr.egc, "y": pr.x1, "p": pr.x2, "do": self.do,
                "seg_chunks": per, "seg_first": first, "scale": self.scale, "T": self.T, "H": self.H})
            self.xs = xs[:, 1 - first:]
        if not start:
            return None
        dS = d_end[0] if d_end is not None else torch.zeros((self.H, self.K, self.V), dtype=torch.float32,
                                                              device=self.dev)
        return _through_reverse(xs, dS, self.V)

    def _reverse(self, dht: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The reverse pass from ``dht`` [1, H, K, V] fp32: (dh, dr, dh0, dv)."""
        ks, H, K, V, T, dev = self.ks, self.H, self.K, self.V, self.T, self.dev
        pr = self.pr
        dh = cd._empty((self.saved["n_hslots"], H, K, V), cd.boundary_dtype(self.do), dev)
        dh0 = cd._empty((1, H, K, V), torch.float32, dev)
        dr = cd._empty((1, T, H, V), self.do.dtype, dev)
        dv = cd._empty((1, T, H, V), self.do.dtype, dev)
        args = cd.reverse_pass_args(pr, self.do, dht.contiguous(), dh, dh0, dr, dv, self.scale, T, H)
        if self.seg[0] == 1:
            name, bv = cd._pass_kernel(ks, cd.BWD_DH, H, V, dev)
            cd._launch(ks, name, (H, cd._cdiv(V, bv)), args)
        else:
            cd.launch_segments(ks, cd.BWD_DH_SEG, self.seg, H, V, args, self.xs.contiguous())
        return dh, dr, dh0, dv

    def grad_walk(self, dht: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rest, with ``dht`` [1, H, K, V] fp32 reaching the piece's end (unused where ``grad_maps`` ran the
        reverse pass): (dq, dk, dv, da, db, dgk, d(entering state) [1, H, K, V])."""
        steps = cd.state_step_operands(self.pr) if cd.derives_states(self.ks) else ()
        fac = self.pr.fac
        dh, dr, dh0, dv = self.done or self._reverse(dht)
        self.pr = self.xs = self.done = None
        if self.side is not None:  # the token pass reads the states pass's h and U
            torch.cuda.current_stream(self.dev).wait_stream(self.side)
        self.held = None  # only now: later uses of their memory on the current stream follow the side stream
        dq, dk, da, db, dg = cd.chunk_dplr_bwd_tokens(self.ks, self.var, self.saved, self.h, self.u, self.do, dh, dr,
                                                      dk_over_dr=True, dq_over_u=True, steps=steps, fac=fac)
        self.h = self.u = self.saved = None
        return dq, dk, dv, da, db, dg, dh0


# ----------------------------------------------------------------------------------------------------------------
# the op


@dataclasses.dataclass
class _Call:
    """What a call's forward leaves its backward besides tensors."""

    ctx: CPContext
    package: "SpecPackage"
    pkg: str
    dense: Optional[str]         # the variant of the entering and the leaving sequence (dense), if either
    mids: Optional[str]          # the other sequences' (varlen if several, else dense)
    scale: float
    confirm: Callable[[], None]  # the ranks' agreement on the call (_start_agreement), before the first exchange
    kernel_bound: Optional[float] = None  # the lower_bound promise the forward's preps check (_check_gates)
    summaries: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A rank's sequences in three parts: the one entering from the rank before (``enter``: its end token, or 0),
    spanning the slice if it also leaves (``span``); the ones that start and end here (``mids``, global ids, tokens
    [mid_lo, mid_hi)); the one that starts here and leaves (its global id ``leave_id`` or None, from token
    ``leave_lo``)."""

    enter: int
    span: bool
    mids: tuple[int, ...]
    mid_lo: int
    mid_hi: int
    leave_id: Optional[int]
    leave_lo: int

    @staticmethod
    def of(ctx: CPContext) -> "_Layout":
        pieces = list(ctx.pieces)
        enters, leaves = ctx.enters[ctx.rank], ctx.leaves[ctx.rank]
        span = enters and leaves and len(pieces) == 1
        enter = pieces.pop(0)[2] if enters else 0
        leave = pieces.pop() if leaves and not span else None
        T = ctx.T_local
        return _Layout(enter, span, tuple(p[0] for p in pieces), pieces[0][1] if pieces else 0,
                       pieces[-1][2] if pieces else 0, None if leave is None else leave[0],
                       T if leave is None else leave[1])


def _rows(x: tuple[torch.Tensor, ...], lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[:, lo:hi] for t in x)


class _CPChunk(torch.autograd.Function):
    """The op on a rank's slice. Forward: the map of the sequence leaving the slice and the entering sequence's
    prep and maps, then the exchange starts; meanwhile the sequences inside and the leaving sequence's pass; then
    the entering sequence's pass from the folded state. Backward mirrored: the gradient reaching the entering state
    and the leaving sequence's prep, states and maps, then the exchange starts; meanwhile the sequences inside and
    the rest of the entering sequence's backward; then the leaving sequence's backward from the folded gradient."""

    @staticmethod
    def forward(fctx: Any, call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, g: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx, lay = call.ctx, _Layout.of(call.ctx)
        _, T, H, K = q.shape
        V = v.shape[-1]
        dev = q.device
        o = cd._empty(v.shape, v.dtype, dev)
        ht = torch.zeros((ctx.num_sequences, H, K, V), dtype=torch.float32, device=dev)
        promise = gate_check.promise_for(g, call.kernel_bound)  # each piece's prep checks its rows
        summary = torch.zeros((H, K, V + K), dtype=torch.float32, device=dev)
        if call.dense is not None:
            ks, var = api.kernels(call.pkg, call.dense, dev)
            xd = (q, k, v, a, b, g.to(api.TORCH_DTYPES[var.gate_dtype]))
        enter = leave = None
        leave_start = None
        # what the next ranks wait for: the map of the sequence leaving this slice
        if lay.span:
            enter = _Piece(ks, var, xd, call.scale)
            summary = enter.maps(total=True, promise=promise)
        elif lay.leave_id is not None:
            leave = _Piece(ks, var, _rows(xd, lay.leave_lo, T), call.scale)
            leave_start = h0[lay.leave_id][None].contiguous()
            if leave.segments() == 1:  # one walk from its known initial state gives the state it leaves with
                leave.maps(total=False, promise=promise)
                summary[:, :, :V] = leave.walk(leave_start, o[:, lay.leave_lo:])[0]
                leave = None
            else:  # P = 0 restarts the fold here
                total = leave.maps(total=True, promise=promise)
                summary[:, :, :V] = torch.baddbmm(total[..., :V], total[..., V:], leave_start[0])
        if lay.enter and not lay.span:
            enter = _Piece(ks, var, _rows(xd, 0, lay.enter), call.scale)
            enter.maps(total=False, promise=promise)
        if promise is not None:
            gate_check.confirm(promise)
        # started only after this rank's own maps: the collective's kernel occupies SMs from its launch until every
        # rank has joined, which would slow the maps it ran beside
        call.confirm()
        gather = _all_gather(summary, ctx)
        # what needs no other rank's summary
        if lay.mids:
            cu, offs = _local_cu(lay.mid_lo, lay.mid_hi, ctx, dev)
            gm = g.to(api.TORCH_DTYPES[call.package.variants[call.mids].gate_dtype])
            xm = _rows((q, k, v, a, b, gm), lay.mid_lo, lay.mid_hi)
            ids = list(lay.mids)
            o[:, lay.mid_lo:lay.mid_hi], ht[ids] = api.chunk_forward(
                call.pkg, call.mids, *xm, h0[ids].contiguous(), cu, call.scale,
                offsets=offs if cu is not None else None, lower_bound=call.kernel_bound)
        if leave is not None:
            leave.walk(leave_start, o[:, lay.leave_lo:])
        summaries = gather.result()
        E = None
        if lay.enter:
            E = _fold_forward(summaries, ctx, V)[None].contiguous()
            end = T if lay.span else lay.enter
            hte = enter.walk(E, o[:, :end])
            if not lay.span:
                ht[ctx.pieces[0][0]] = hte[0]
        call.summaries = summaries
        fctx.call, fctx.E = call, E
        fctx.save_for_backward(q, k, v, a, b, g, h0)
        return o, ht

    @staticmethod
    def backward(fctx: Any, do: torch.Tensor, dht: torch.Tensor) -> tuple[Any, ...]:
        call: _Call = fctx.call
        ctx, lay = call.ctx, _Layout.of(call.ctx)
        q, k, v, a, b, g, h0 = fctx.saved_tensors
        _, T, H, K = q.shape
        V = v.shape[-1]
        dev = q.device
        do = do.contiguous()
        dht = dht.to(torch.float32)
        dh0 = torch.zeros_like(h0)
        parts: list[tuple[tuple[torch.Tensor, ...], int, int]] = []
        if call.dense is not None:
            ks, var = api.kernels(call.pkg, call.dense, dev)
            xd = (q, k, v, a, b, g.to(api.TORCH_DTYPES[var.gate_dtype]))
        # what the previous ranks wait for: the gradient reaching the entering state from this slice's outputs
        # (and, where the entering sequence ends here, from its final state's gradient)
        G = torch.zeros((H, K, V), dtype=torch.float32, device=dev)
        enter = leave = None
        if lay.enter:
            end = T if lay.span else lay.enter
            enter = _Piece(ks, var, _rows(xd, 0, end), call.scale)
            d_end = None if lay.span else dht[ctx.pieces[0][0]][None].contiguous()
            G = enter.grad_maps(fctx.E, do[:, :end], d_end, start=True)
        if lay.leave_id is not None:
            leave = _Piece(ks, var, _rows(xd, lay.leave_lo, T), call.scale)
            leave.grad_maps(h0[lay.leave_id][None].contiguous(), do[:, lay.leave_lo:], None, start=False)
        gather = _all_gather(G, ctx)  # after this rank's own maps, as in the forward
        # what needs no other rank's gradient
        if lay.mids:
            cu, offs = _local_cu(lay.mid_lo, lay.mid_hi, ctx, dev)
            gm = g.to(api.TORCH_DTYPES[call.package.variants[call.mids].gate_dtype])
            ids = list(lay.mids)
            *part, dh0[ids] = api.chunk_backward(
                call.pkg, call.mids, *_rows((q, k, v, a, b, gm), lay.mid_lo, lay.mid_hi), h0[ids].contiguous(), cu,
                call.scale, do[:, lay.mid_lo:lay.mid_hi], dht[ids].contiguous(),
                offsets=offs if cu is not None else None)
            parts.append((tuple(part), lay.mid_lo, lay.mid_hi))
        if lay.enter and not lay.span:
            parts.append((enter.grad_walk(d_end)[:6], 0, end))
        grads_in = gather.result()
        if ctx.leaves[ctx.rank]:
            dS = _fold_backward(grads_in, call.summaries, ctx, V)[None].contiguous()
            if lay.span:
                parts.append((enter.grad_walk(dS)[:6], 0, T))
            else:
                *part, dh0_i = leave.grad_walk(dS)
                dh0[lay.leave_id] = dh0_i[0]
                parts.append((tuple(part), lay.leave_lo, T))
        return (None, *_assemble(parts, (q, k, v, a, b, g)), dh0)


def _assemble(parts: list[tuple[tuple[torch.Tensor, ...], int, int]], inputs: tuple[torch.Tensor, ...]
              ) -> tuple[torch.Tensor, ...]:
    """The gradients of ``inputs`` [1, T, ...] from the parts computed for their rows [lo, hi): one part covering
    every row is returned as it is (no copy)."""
    T = inputs[0].shape[1]
    if len(parts) == 1 and parts[0][1:] == (0, T):
        grads = parts[0][0]
    else:
        grads = tuple(cd._empty(t.shape, t.dtype, t.device) for t in inputs)
        for part, lo, hi in parts:
            for dst, src in zip(grads, part):
                dst[:, lo:hi] = src
    return tuple(t.to(ref.dtype) if t.dtype != ref.dtype else t for t, ref in zip(grads, inputs))


def _local_cu(lo: int, hi: int, ctx: CPContext, device: torch.device) -> tuple[Optional[torch.Tensor], list[int]]:
    """The boundaries of the local sequences in tokens [lo, hi), from lo (None for one sequence: the dense op)."""
    offs = [x - lo for x in ctx.cu_seqlens_cpu.tolist() if lo <= x <= hi]
    if len(offs) == 2:
        return None, offs
    return torch.tensor(offs, dtype=torch.int32, device=device), offs


def run(names: tuple[str, ...], package: "SpecPackage", tensors: tuple[torch.Tensor, ...], scale: Any,
        initial_state: Any, output_final_state: bool, cu_seqlens: Any, cu_seqlens_cpu: Any, chunk_size: Optional[int],
        lower_bound: Optional[float], cp_context: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A chunk op (q, k, v, a, b, gk in ``tensors``, named ``names``) on this rank's slice under ``cp_context``.
    Each rank checks its arguments, then the ranks exchange a descriptor of their calls: an error on one rank is
    raised on every rank (its own message there, a pointer to it elsewhere) instead of leaving the others waiting."""
    ctx = cp_context
    if not isinstance(ctx, CPContext):
        raise TypeError(f"cp_context must come from dplr_gen.cp.build_cp_context, got {type(ctx).__name__}")
    if torch.compiler.is_compiling():
        raise NotImplementedError("cp_context is not supported under torch.compile (its host-side exchange would "
                                  "break the graph); call the op eagerly")
    err: Optional[Exception] = None
    info: Optional[dict[str, Any]] = None
    kernel_bound: Optional[float] = None
    try:
        info = _check_call(names, tensors, scale, initial_state, cu_seqlens, chunk_size, lower_bound, ctx)
        variant_a, variant_b = _variants(package, tensors, chunk_size, lower_bound, ctx)
        if lower_bound is not None and ctx.world_size > 1:  # a group of one: the plain op checks
            kernel_bound = _check_gates(package, tensors[5], lower_bound, (variant_a, variant_b))
    except (TypeError, ValueError) as e:
        if ctx.world_size == 1:
            raise
        err = e
    if ctx.world_size == 1:  # a group of one: the plain op on the whole batch
        single = ctx.num_sequences == 1
        return api.run(package, names, tensors, scale, initial_state, output_final_state,
                       None if single else ctx.cu_seqlens.to(tensors[0].device),
                       None if single else ctx.cu_seqlens_cpu, chunk_size, lower_bound)
    confirm = _start_agreement(ctx, info, err)
    if err is not None:
        confirm()  # raises: this rank's error, or the ranks' disagreement that may have caused it
    q, k, v, a, b, g = tensors
    N, H, K, V = ctx.num_sequences, info["H"], info["K"], info["V"]
    h0 = (torch.zeros((N, H, K, V), dtype=torch.float32, device=q.device) if initial_state is None
          else initial_state.to(torch.float32))
    call = _Call(ctx, package, package.dir_str, variant_a, variant_b, info["scale"], confirm, kernel_bound)
    args = [t.contiguous() for t in (q, k, v, a, b, g, h0)]
    o, ht = _CPChunk.apply(call, *args)
    return o, (ht if output_final_state else None)


def _check_call(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], scale: Any, initial_state: Any,
                cu_seqlens: Any, chunk_size: Optional[int], lower_bound: Optional[float], ctx: CPContext
                ) -> dict[str, Any]:
    """This rank's argument checks; returns the checked shapes, dtypes and scale."""
    if cu_seqlens is not None and not (cu_seqlens is ctx.cu_seqlens or (
            isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.tolist() == ctx.cu_seqlens_cpu.tolist())):
        raise ValueError("cu_seqlens: under cp_context the rank's sequence boundaries come from the context "
                         "(cp_context.cu_seqlens); pass cu_seqlens=None")
    info = api.check_inputs(names, tensors, scale)
    info.update(dtype=tensors[0].dtype, gate_dtype=tensors[5].dtype)
    api.check_keywords(chunk_size, lower_bound)
    B, T, H, K, V = (info[n] for n in ("B", "T", "H", "K", "V"))
    if B != 1:
        raise ValueError(f"under cp_context the batch is packed: {names[0]} must be [1, T_local, H, K], got B = {B}")
    N = ctx.num_sequences
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (N, H, K, V):
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise ValueError(f"initial_state must be [N_global, H, K, V] = {(N, H, K, V)} under cp_context (one per "
                             f"global sequence, the same on every rank), got {got}")
        if initial_state.device != tensors[0].device:
            raise ValueError(f"initial_state is on {initial_state.device} but {names[0]} is on {tensors[0].device}")
    place = dist.get_rank(ctx.group)
    if place != ctx.rank:
        raise ValueError(f"cp_context was built for rank {ctx.rank} of its group, but this process is rank {place} "
                         "there: a context built for another group or process")
    if T * ctx.world_size != ctx.offsets[-1]:
        raise ValueError(f"cp_context: cu_seqlens total T_global = {ctx.offsets[-1]} must be world_size "
                         f"({ctx.world_size}) x T_local, but {names[0]} has T_local = {T} tokens on rank {ctx.rank}")
    return info


def _check_gates(package: "SpecPackage", g: torch.Tensor, lower_bound: float, variants: tuple[Optional[str], ...]
                 ) -> Optional[float]:
    """This rank's gates against the caller's lower_bound promise (gate_check): where every variant the call runs
    is bounded, their forward preps check it (returns the bound they check, as the plain op does; no pass of its
    own over gk); else here. A broken promise found on the host (CPU tensors, the sync mode) is a ValueError that
    the ranks' agreement carries to every rank."""
    bounded = all(package.variants[n].gate_bound is not None for n in variants if n is not None)
    return gate_check.check_lower_bound(g, lower_bound, in_kernel=bounded)


def _variants(package: "SpecPackage", tensors: tuple[torch.Tensor, ...], chunk_size: Optional[int],
              lower_bound: Optional[float], ctx: CPContext) -> tuple[Optional[str], Optional[str]]:
    """(the dense variant of the sequences crossing this rank's boundaries, the variant of those inside it (varlen
    if several, else dense)); None where there are none."""
    if ctx.world_size == 1:
        return None, None
    q, _, v, _, _, g = tensors
    lay = _Layout.of(ctx)
    dense = mids = None
    if lay.enter or lay.leave_id is not None:
        dense = api.variant_for(package, q, v, g, None, chunk_size, lower_bound)
        _need_maps(*api.kernels(package.dir_str, dense, q.device))
    if lay.mids:
        mids = api.variant_for(package, q, v, g, ctx.cu_seqlens if len(lay.mids) > 1 else None, chunk_size,
                               lower_bound)
    return dense, mids

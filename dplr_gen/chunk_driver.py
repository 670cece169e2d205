"""Host side of the chunked DPLR kernels (templates/chunk_dplr.py.jinja): allocations, grids, launches.

No autograd and no validation here: inputs arrive contiguous, in the variant's dtypes. Kernels are launched
through a kernel set ``ks`` (``ks.<kernel>[grid](*runtime_args)``, ``ks.constexprs(<kernel>)``), which adds the
constexpr arguments and launch options of the variant. Nothing here synchronises with the device.

Chunk slots (where the per-chunk states live): dense, sequence n owns slots n*NT .. n*NT+NT-1
(NT = ceil(T / C)); varlen, the chunk starting at token s of sequence n owns slot s // C + n, which is unique
and below T_total // C + N, so every buffer is sized without reading cu_seqlens on the host.
"""

from __future__ import annotations

import torch

FWD = "chunk_dplr_fwd_kernel"
BWD_DH = "chunk_dplr_bwd_dh_kernel"
BWD = "chunk_dplr_bwd_kernel"

# Tests set this to fill every output and scratch buffer with NaN before a launch, so that an element a
# kernel fails to write shows up.
POISON = False


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _empty(shape, dtype, device) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _layout(v, q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[int, int]:
    """(number of sequences N, number of chunk slots)."""
    B, T = q.shape[0], q.shape[1]
    C = v.chunk_size
    if cu_seqlens is None:
        return B, B * _cdiv(T, C)
    N = cu_seqlens.numel() - 1
    return N, T // C + N


def chunk_map_from_cu_seqlens(cu_seqlens: torch.Tensor, C: int, n_slots: int) -> torch.Tensor:
    """int32 [n_slots, 2]: (sequence, chunk index within it) per slot; chunk index -1 marks an unused slot.

    Built on the device with a searchsorted over the first slot of each sequence (no host sync):
    O(n_slots log N) work, one small tensor of 8 bytes per slot.
    """
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    first = cu[:-1] // C + torch.arange(N, device=cu.device)  # first slot of each sequence, increasing
    nch = (cu[1:] - cu[:-1] + C - 1) // C
    slots = torch.arange(n_slots, device=cu.device)
    n = (torch.searchsorted(first, slots, right=True) - 1).clamp_(0, N - 1)
    i_t = slots - first[n]
    i_t = torch.where((i_t >= 0) & (i_t < nch[n]), i_t, torch.full_like(i_t, -1))
    return torch.stack([n, i_t], 1).to(torch.int32).contiguous()


def chunk_dplr_fwd(ks, v, q, k, v_, a, b, gk, scale: float, initial_state, cu_seqlens):
    """Returns (o, final_state [N, H, K, V] fp32, saved).

    Saved for the backward: the inputs and the fp32 state entering every chunk (``h``, [slots, H, K, V]);
    the A matrices, (I - A_ab)^-1 and U are recomputed in the backward (cheaper than storing C x C and C x V
    tiles per chunk, and the backward kernels need them at other precisions/orientations anyway).
    """
    B, T, H, K = q.shape
    V = v_.shape[-1]
    N, n_slots = _layout(v, q, cu_seqlens)
    dev = q.device
    o = _empty((B, T, H, V), v_.dtype, dev)
    ht = _empty((N, H, K, V), torch.float32, dev)
    h = _empty((n_slots, H, K, V), torch.float32, dev)
    BV = ks.constexprs(FWD)["BV"]
    args = [q, k, v_, a, b, gk, o, initial_state, h, ht]
    if cu_seqlens is not None:
        args.append(cu_seqlens)
    args += [float(scale), T, H]
    getattr(ks, FWD)[(N * H, _cdiv(V, BV))](*args)
    return o, ht, saved_for_backward(v, q, k, v_, a, b, gk, h, scale, cu_seqlens)


def states_shape(v, q: torch.Tensor, V: int, cu_seqlens: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Shape of the chunk-start states ``h`` the forward writes: [slots, H, K, V]."""
    return (_layout(v, q, cu_seqlens)[1], q.shape[2], q.shape[3], V)


def saved_for_backward(v, q, k, v_, a, b, gk, h, scale: float, cu_seqlens) -> dict:
    """What the backward kernels need: the inputs and the fp32 chunk-start states (from the forward, kept or
    recomputed)."""
    N, n_slots = _layout(v, q, cu_seqlens)
    return {
        "q": q, "k": k, "v": v_, "a": a, "b": b, "gk": gk, "h": h,
        "scale": float(scale), "cu_seqlens": cu_seqlens, "N": N, "n_slots": n_slots,
    }


def chunk_dplr_bwd_dh(ks, v, saved, do: torch.Tensor, dht: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reverse pass: dS at the end of every chunk (``dh`` [slots, H, K, V]) and d(initial state) (fp32)."""
    q, k, a, b, gk = (saved[n] for n in ("q", "k", "a", "b", "gk"))
    scale, cu_seqlens, N, n_slots = saved["scale"], saved["cu_seqlens"], saved["N"], saved["n_slots"]
    _, T, H, K = q.shape
    V = saved["v"].shape[-1]
    dev = q.device
    if dht is None:
        dht = torch.zeros((N, H, K, V), dtype=torch.float32, device=dev)
    dht = dht.to(torch.float32).contiguous()
    dh = _empty((n_slots, H, K, V), torch.float32, dev)
    dh0 = _empty((N, H, K, V), torch.float32, dev)
    BV = ks.constexprs(BWD_DH)["BV"]
    args = [q, k, a, b, gk, do, dht, dh, dh0]
    if cu_seqlens is not None:
        args.append(cu_seqlens)
    args += [scale, T, H]
    getattr(ks, BWD_DH)[(N * H, _cdiv(V, BV))](*args)
    return dh, dh0


def chunk_dplr_bwd_tokens(ks, v, saved, do: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The chunk-parallel pass: (dq, dk, dv, da, db, dgk) from the saved chunk-start states and ``dh``."""
    q, k, v_, a, b, gk, h = (saved[n] for n in ("q", "k", "v", "a", "b", "gk", "h"))
    scale, cu_seqlens, n_slots = saved["scale"], saved["cu_seqlens"], saved["n_slots"]
    _, T, H, _ = q.shape
    dev = q.device
    dq = _empty(q.shape, q.dtype, dev)
    dk = _empty(k.shape, k.dtype, dev)
    dv = _empty(v_.shape, v_.dtype, dev)
    da = _empty(a.shape, a.dtype, dev)
    db = _empty(b.shape, b.dtype, dev)
    dg = _empty(gk.shape, gk.dtype, dev)
    args = [q, k, v_, a, b, gk, h, dh, do, dq, dk, dv, da, db, dg]
    if cu_seqlens is not None:
        args += [cu_seqlens, chunk_map_from_cu_seqlens(cu_seqlens, v.chunk_size, n_slots)]
    args += [scale, T, H]
    getattr(ks, BWD)[(n_slots * H,)](*args)
    return dq, dk, dv, da, db, dg


def chunk_dplr_bwd(ks, v, saved, do, dht):
    """Returns (dq, dk, dv, da, db, dgk, dh0): gradients in the input dtypes, dgk in the gate dtype, dh0 fp32."""
    do = do.contiguous()
    dh, dh0 = chunk_dplr_bwd_dh(ks, v, saved, do, dht)
    return (*chunk_dplr_bwd_tokens(ks, v, saved, do, dh), dh0)

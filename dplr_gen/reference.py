"""Pure-PyTorch reference of the DPLR delta rule (docs/math.md, "The recurrence"), one step at a time.

It is the ground truth every kernel is tested against: run it on float64 inputs and it is exact to rounding.
It is differentiable with plain autograd, so reference gradients come from ``torch.autograd.grad``.
"""

from __future__ import annotations

import torch


def naive_dplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T ;  o_t = scale * S_t^T q_t.

    Inputs ``[B, T, H, K]`` (v ``[B, T, H, V]``), state ``[N, H, K, V]``. Computes in the dtype of ``q``
    (pass float64 tensors for a reference); returns ``o`` in that dtype and the final state likewise.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    if cu_seqlens is None:
        bounds = [(i, 0, T) for i in range(B)]
    else:
        cs = [int(x) for x in cu_seqlens.tolist()]
        bounds = [(0, cs[n], cs[n + 1]) for n in range(len(cs) - 1)]
    dt = q.dtype
    seq_outs = []
    finals = []
    for n, (bi, start, end) in enumerate(bounds):
        if initial_state is not None:
            S = initial_state[n].to(dt)
        else:
            S = torch.zeros(H, K, V, dtype=dt, device=q.device)
        rows = []
        for t in range(start, end):
            qt, kt, vt = q[bi, t].to(dt), k[bi, t].to(dt), v[bi, t].to(dt)
            at, bt, gt = a[bi, t].to(dt), b[bi, t].to(dt), gk[bi, t].to(dt)
            u = torch.einsum("hk,hkv->hv", at, S)
            S = torch.exp(gt)[..., None] * S + bt[..., None] * u[:, None, :] + kt[..., None] * vt[:, None, :]
            rows.append(scale * torch.einsum("hk,hkv->hv", qt, S))
        seq_outs.append(torch.stack(rows, 0) if rows else q.new_zeros(0, H, V, dtype=dt))
        finals.append(S)
    # dense: one row of the batch per sequence; varlen: sequences laid end to end in the one row
    o = torch.stack(seq_outs, 0) if cu_seqlens is None else torch.cat(seq_outs, 0)[None]
    final = torch.stack(finals, 0) if output_final_state else None
    return o, final


def naive_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RWKV-7 argument order (r, w, k, v, a, b) over the same recurrence."""
    return naive_dplr_delta_rule(r, k, v, a, b, w, scale, initial_state, output_final_state, cu_seqlens)

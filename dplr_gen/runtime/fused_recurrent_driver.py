"""Host side of the fused recurrent forward: allocations, grid and launch (no checks: ops.py did them).

The kernel's arguments are passed by name in the order its SIGNATURES declare (plan/fused_recurrent_plan.py), and
its V tile is read back from CONSTEXPRS (the plan's ``block_v``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan.fused_recurrent_plan import FWD, STEP
from .chunk_driver import _cdiv, _empty, _launch, _stub


def fused_recurrent_dplr_fwd(
    ks: Any, var: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    gk: torch.Tensor, scale: float, h0: torch.Tensor, cu_seqlens: torch.Tensor | None,
    state_indices: torch.Tensor | None = None, mul_ab: bool = False, one_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final states) of the variant ``var`` (its kernel set ``ks``): varlen where ``cu_seqlens`` is given.
    ``state_indices`` (int32 [N]): ``h0`` is a pool of states, sequence n's at slot state_indices[n], read and
    written in place (the pool is returned as the final states). ``mul_ab``: a holds kk and b the rate a of
    RWKV-7's fused form (the step uses -kk and kk * a). Where every sequence is one token long (T = 1 without
    ``cu_seqlens``, or ``one_token``: the caller read cu_seqlens on the host), the decode step's kernel runs
    (where the unit has it) instead of the loop over time."""
    B, T, H, _ = q.shape
    if state_indices is None:
        N, ht, idx = h0.shape[0], _empty(h0.shape, h0.dtype, h0.device), _stub(torch.int32, q.device)
    else:
        N, ht, idx = state_indices.shape[0], h0, state_indices
    o = _empty(v.shape, v.dtype, v.device)
    args = {"q": q, "k": k, "v": v, "a": a, "b": b, "gk": gk, "o": o, "h0": h0, "ht": ht, "state_idx": idx,
            "cu_seqlens": cu_seqlens, "scale": scale, "T": T, "H": H, "n_slots": h0.shape[0],
            "use_idx": int(state_indices is not None), "mul_ab": int(mul_ab)}
    step = (one_token or (T == 1 and cu_seqlens is None)) and ks.has(STEP)
    name = STEP if step else FWD
    _launch(ks, name, (N * H, _cdiv(v.shape[-1], ks.constexprs(name)["BV"])), args)
    return o, ht

"""Host side of the fused recurrent forward: allocations, grid and launch (no checks: ops.py did them).

The kernel's arguments are passed by name in the order its SIGNATURES declare (plan/fused_recurrent_plan.py), and
its V tile is read back from CONSTEXPRS (the plan's ``block_v``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan.fused_recurrent_plan import FWD
from .chunk_driver import _cdiv, _launch


def fused_recurrent_dplr_fwd(
    ks: Any, var: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    gk: torch.Tensor, scale: float, h0: torch.Tensor, cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final states) of the variant ``var`` (its kernel set ``ks``): varlen where ``cu_seqlens`` is given."""
    B, T, H, _ = q.shape
    N = h0.shape[0]
    o = torch.empty_like(v)
    ht = torch.empty_like(h0)
    grid = (N * H, _cdiv(v.shape[-1], ks.constexprs(FWD)["BV"]))
    _launch(ks, FWD, grid, {"q": q, "k": k, "v": v, "a": a, "b": b, "gk": gk, "o": o, "h0": h0, "ht": ht,
                            "cu_seqlens": cu_seqlens, "scale": scale, "T": T, "H": H})
    return o, ht

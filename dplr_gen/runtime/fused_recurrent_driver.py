"""Host side of the fused recurrent forward: allocations, grid and launch (no checks: ops.py did them)."""

from __future__ import annotations

from typing import Any

import torch

from .chunk_driver import _cdiv


def fused_recurrent_dplr_fwd(
    ks: Any, var: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    gk: torch.Tensor, scale: float, h0: torch.Tensor, cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, _ = q.shape
    N = h0.shape[0]
    name = "fused_recurrent_dplr_fwd_kernel"
    BV = ks.constexprs(name)["BV"]
    o = torch.empty_like(v)
    ht = torch.empty_like(h0)
    grid = (N * H, _cdiv(v.shape[-1], BV))
    extra = (cu_seqlens,) if var.varlen else ()
    getattr(ks, name)[grid](q, k, v, a, b, gk, o, h0, ht, *extra, scale, T, H)
    return o, ht

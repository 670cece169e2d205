"""Random inputs shaped like a real RWKV-7 layer's, and the relative-norm error used by every check."""

from __future__ import annotations

import torch

RWKV7_GATE_BOUND = -0.6065  # exp(-0.5) clamp of RWKV-7: w = -exp(-0.5) * sigmoid(x)


def rwkv7_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    initial_state: bool = True,
    gate_bound: float = RWKV7_GATE_BOUND,
) -> dict[str, torch.Tensor | None]:
    """q, k, v, a, b, gk (and h0) in fla's layout: a = -kk, b = kk * iclr with kk L2-normalised, gk in (bound, 0)."""
    V = K if V is None else V
    gen = torch.Generator(device="cpu")
    gen.manual_seed(torch.seed() if seed is None else seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = rnd(B, T, H, K)
    k = rnd(B, T, H, K) * K**-0.5
    v = rnd(B, T, H, V)
    kk = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    iclr = torch.sigmoid(rnd(B, T, H, K))
    gk = -(-gate_bound) * torch.sigmoid(rnd(B, T, H, K))
    out: dict[str, torch.Tensor | None] = {
        "q": q, "k": k, "v": v, "a": -kk, "b": kk * iclr, "gk": gk,
        "initial_state": rnd(B, H, K, V) * 0.5 if initial_state else None,
    }
    return {
        n: (None if t is None else t.to(device=device, dtype=torch.float32 if n == "initial_state" else dtype))
        for n, t in out.items()
    }


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN or Inf anywhere gives inf."""
    x64, r64 = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x64).all():
        return float("inf")
    den = r64.norm().item()
    return (x64 - r64).norm().item() / (den if den > 0 else 1.0)

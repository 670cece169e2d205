"""A minimal RWKV-7-like language model on dplr-gen's ops, shared by the examples (train_cp.py, generate.py).

Each block: a time mix (projections to r, w, k, v, kk, a from the normalised input; the DPLR recurrence with
a = -kk, b = kk * a as RWKV-7 forms them; a per-head norm; an output projection) and a channel mix (squared-ReLU
MLP). No token shift: every op besides the recurrence acts on each token alone, so a packed batch split over ranks
(context parallelism) gives exactly the one-process result, with the recurrence carried across ranks by the op.
Not fla's model (see dplr_gen.integrations.fla to run that one on dplr-gen).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import dplr_gen

# w = DECAY * sigmoid(.) lies in (DECAY, 0); the op is promised gk >= LOWER_BOUND (with room for rounding), which
# selects dplr-gen's faster bounded variants
DECAY, LOWER_BOUND = -0.6, -0.61


class TimeMix(nn.Module):
    def __init__(self, hidden: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = hidden // head_dim, head_dim
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, 6 * hidden, bias=False)
        self.out_norm = nn.GroupNorm(self.heads, hidden)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(r, w, k, v, kk, rate) [B, T, H, K] in one dtype (the op takes q, k, v, a, b in one dtype; under
        autocast the norm's output would be fp32)."""
        B, T, _ = x.shape
        p = self.proj(self.norm(x))
        r, w, k, v, kk, rate = p.view(B, T, 6, self.heads, self.head_dim).unbind(2)
        w = DECAY * torch.sigmoid(w)
        k = k * self.head_dim**-0.5  # keeps the state's scale independent of K
        kk = F.normalize(kk, dim=-1)
        rate = torch.sigmoid(rate)
        return tuple(t.to(p.dtype) for t in (r, w, k, v, kk, rate))

    def _finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        n = self.out_norm  # in fp32 whatever the weights' dtype (bf16 for inference)
        o = F.group_norm(o.reshape(B * T, D).float(), n.num_groups, n.weight.float(), n.bias.float(), n.eps)
        return x + self.out(o.view(B, T, D).to(x.dtype))

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, cp_context: Any = None,
                want_state: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The chunk op over whole sequences (training, prefill); with ``want_state`` also each sequence's final
        state [N, H, K, V] fp32."""
        r, w, k, v, kk, rate = self._inputs(x)
        kw: dict[str, Any] = {"cp_context": cp_context} if cp_context is not None else {"cu_seqlens": cu_seqlens}
        o, state = dplr_gen.chunk_rwkv7(r, w, k, v, -kk, kk * rate, scale=1.0, output_final_state=want_state,
                                        lower_bound=LOWER_BOUND, **kw)
        return self._finish(x, o), state

    def step(self, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token per sequence ([B, 1, D]) with the fused recurrent op in RWKV-7's decoding form: sequence i's
        state is slot slots[i] of the state pool [num_slots, H, K, V] fp32, read and written in place (no host
        work that waits for the device: a CUDA graph can hold it)."""
        r, w, k, v, kk, rate = self._inputs(x)
        o, _ = dplr_gen.fused_mul_recurrent_rwkv7(r, w, k, v, kk, rate, scale=1.0, initial_state=pool,
                                                  ssm_state_indices=slots)
        return self._finish(x, o)


class ChannelMix(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))) ** 2)


class TinyRWKV7(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, head_dim: int) -> None:
        super().__init__()
        if hidden % head_dim:
            raise ValueError(f"hidden ({hidden}) must be a multiple of head_dim ({head_dim})")
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.ModuleList(TimeMix(hidden, head_dim) for _ in range(layers))
        self.ffn = nn.ModuleList(ChannelMix(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.heads, self.head_dim = hidden // head_dim, head_dim

    def forward(self, ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, cp_context: Any = None,
                want_states: bool = False) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """Logits [B, T, vocab] of whole sequences (packed with ``cu_seqlens``, or this rank's slice of a packed
        batch under ``cp_context``); with ``want_states`` each layer's final states [N, H, K, V] fp32."""
        x = self.embed(ids)
        states = []
        for mix, ffn in zip(self.mix, self.ffn):
            x, s = mix(x, cu_seqlens, cp_context, want_states)
            x = ffn(x)
            states.append(s)
        return self.head(self.norm(x)), states

    def step(self, ids: torch.Tensor, pools: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of one new token per sequence (``ids`` [B, 1]); each layer's states in ``pools``."""
        x = self.embed(ids)
        for mix, ffn, pool in zip(self.mix, self.ffn, pools):
            x = ffn(mix.step(x, pool, slots))
        return self.head(self.norm(x))[:, -1]

"""A stand-in ``fla`` package for CPU tests of code that drives fla's RWKV-7 model (fla is not installed here): the
modules and names of fla 0.6 that dplr_gen.integrations.fla patches, a layer calling the two ops as fla's
RWKV7Attention.forward does, and a tiny RWKV7ForCausalLM (embedding, those layers, a head; a dict as the cache).
Its "fla kernels" are dplr-gen's float64-capable step-by-step reference, so results differ from dplr-gen's kernels
by rounding only."""

from __future__ import annotations

import textwrap
from pathlib import Path

FILES = {
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "from .rwkv7 import chunk_rwkv7\n",
    "fla/ops/rwkv7/__init__.py": """
        from .chunk import chunk_rwkv7
        from .fused_recurrent import fused_mul_recurrent_rwkv7
        """,
    "fla/ops/rwkv7/chunk.py": """
        from dplr_gen.reference import naive_rwkv7

        def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                        cu_seqlens_cpu=None, safe_gate=False, chunk_size=None, disable_recompute=False,
                        cp_context=None, lower_bound=None):
            return naive_rwkv7(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
        """,
    "fla/ops/rwkv7/fused_recurrent.py": """
        from dplr_gen.reference import naive_rwkv7

        def fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=None, output_final_state=False,
                                      reverse=False, cu_seqlens=None):
            return naive_rwkv7(r, w, k, v, -kk, kk * a, scale, initial_state, output_final_state, cu_seqlens)
        """,
    "fla/layers/__init__.py": "from .rwkv7 import RWKV7Attention\n",
    "fla/layers/rwkv7.py": """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        from fla.ops.rwkv7 import chunk_rwkv7, fused_mul_recurrent_rwkv7


        class RWKV7Attention(nn.Module):
            def __init__(self, hidden_size, head_dim, layer_idx):
                super().__init__()
                self.head_dim, self.layer_idx = head_dim, layer_idx
                self.proj = nn.Linear(hidden_size, 6 * hidden_size, bias=False)
                self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

            def forward(self, x, cache=None, use_cache=False):
                B, T, D = x.shape
                r, w, k, v, kk, a = self.proj(x).view(B, T, 6, D // self.head_dim, self.head_dim).unbind(2)
                w = -0.6065306597126334 * w.sigmoid()
                kk = F.normalize(kk, dim=-1)
                a = a.sigmoid()
                k = 0.1 * k
                state = None if cache is None else cache.get(self.layer_idx)
                # fla 0.6's dispatch and arguments
                if self.training or T >= 64 or torch.is_grad_enabled():
                    o, state = chunk_rwkv7(r=r, w=w, k=k, v=v, a=-kk, b=kk * a, scale=1., initial_state=state,
                                           output_final_state=use_cache, cu_seqlens=None, safe_gate=True,
                                           lower_bound=-0.6065306597126334, chunk_size=64)
                else:
                    o, state = fused_mul_recurrent_rwkv7(r=r, w=w, k=k, v=v, kk=kk, a=a, scale=1.,
                                                         initial_state=state, output_final_state=use_cache,
                                                         cu_seqlens=None)
                if use_cache and cache is not None:
                    cache[self.layer_idx] = state
                return self.o_proj(o.reshape(B, T, D))
        """,
    "fla/models/__init__.py": "from .rwkv7 import RWKV7Config, RWKV7ForCausalLM\n",
    "fla/models/rwkv7.py": """
        from types import SimpleNamespace

        import torch.nn as nn
        import torch.nn.functional as F

        from fla.layers.rwkv7 import RWKV7Attention


        class RWKV7Config:
            def __init__(self, hidden_size=64, num_hidden_layers=1, head_dim=64, vocab_size=32, **kwargs):
                self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
                self.head_dim, self.vocab_size = head_dim, vocab_size


        class RWKV7ForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                D = config.hidden_size
                self.embeddings = nn.Embedding(config.vocab_size, D)
                self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(config.num_hidden_layers))
                self.layers = nn.ModuleList(RWKV7Attention(D, config.head_dim, i)
                                            for i in range(config.num_hidden_layers))
                self.lm_head = nn.Linear(D, config.vocab_size, bias=False)

            def forward(self, input_ids, labels=None, past_key_values=None, use_cache=None, **kwargs):
                cache = past_key_values if past_key_values is not None else ({} if use_cache else None)
                h = self.embeddings(input_ids)
                for norm, layer in zip(self.norms, self.layers):
                    h = h + layer(norm(h), cache, bool(use_cache))
                logits = self.lm_head(h)
                loss = None
                if labels is not None:
                    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
                return SimpleNamespace(loss=loss, logits=logits, past_key_values=cache)
        """,
}


def write_standin(root: Path) -> Path:
    """Writes the stand-in package under ``root`` (put ``root`` on sys.path / PYTHONPATH); returns ``root``."""
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root

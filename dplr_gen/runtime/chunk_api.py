"""The chunk op's run-time pieces, named for the layers above the runtime (dplr_gen.cp runs a rank's slice with
them): the argument checks, the variant choice, a variant's kernels, the forward and backward of a (varlen) batch,
and the whole op. Thin names over dplr_gen.runtime.ops, whose own helpers stay private: a caller above the runtime
imports this module and nothing else of the op's, so the op can change its internals without breaking it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from . import ops
from .ops import TORCH_DTYPES  # noqa: F401 - the dtype of a variant's name ("bf16", ...) -> torch dtype

if TYPE_CHECKING:
    from .loader import KernelSet, SpecPackage
    from ..plan.variant import Variant


def check_inputs(names: tuple[str, ...], tensors: tuple[Any, ...], scale: Any, initial_state: Any = None,
                 cu_seqlens: Any = None, cu_seqlens_cpu: Any = None) -> dict[str, Any]:
    """The op's checks of (q, k, v, a, b, gk) named ``names`` (errors name the argument); returns B, T, H, K, V,
    N, the scale and the host offsets of cu_seqlens."""
    return ops._check_inputs(names, tensors, scale, initial_state, cu_seqlens, cu_seqlens_cpu)


def check_keywords(chunk_size: Any, lower_bound: Any) -> None:
    """The op's checks of ``chunk_size`` and ``lower_bound``."""
    ops._check_keywords(chunk_size, lower_bound)


def variant_for(package: "SpecPackage", q: torch.Tensor, v: torch.Tensor, gk: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                lower_bound: Optional[float] = None) -> str:
    """The chunk variant the op runs for these (checked) inputs and keywords."""
    return ops.variant_for(package, "chunk", q, v, gk, cu_seqlens, chunk_size, lower_bound)


def kernels(pkg: str, variant: str, device: torch.device) -> tuple["KernelSet", "Variant"]:
    """(kernel set, variant) of ``variant`` of the package in folder ``pkg`` for ``device`` (memoised)."""
    return ops._kernels(pkg, variant, device)


def chunk_forward(pkg: str, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                  b: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                  scale: float, offsets: Optional[list[int]] = None, lower_bound: Optional[float] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final states [N, H, K, V] fp32) of a batch (varlen with ``cu_seqlens`` int32 and its host ``offsets``),
    no autograd; ``lower_bound``: the promise the bounded variant's prep checks (gate_check.check_lower_bound)."""
    o, ht = ops._chunk_fwd_run(pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale, False, offsets=offsets,
                               lower_bound=lower_bound)[:2]
    return o, ht


def chunk_backward(pkg: str, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                   scale: float, do: torch.Tensor, dht: Optional[torch.Tensor], offsets: Optional[list[int]] = None
                   ) -> tuple[torch.Tensor, ...]:
    """Gradients of (q, k, v, a, b, gk, h0) of that batch, the forward's states recomputed."""
    return ops._chunk_bwd_run(pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale, do, dht, None, None,
                              offsets=offsets)


def run(package: "SpecPackage", names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], scale: Any,
        initial_state: Any, output_final_state: bool, cu_seqlens: Any, cu_seqlens_cpu: Any,
        chunk_size: Optional[int], lower_bound: Optional[float]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The whole chunk op (checks, autograd) on one process's batch, as the public op runs it."""
    return ops._run("chunk", package, names, tensors, scale, initial_state, output_final_state, cu_seqlens,
                    cu_seqlens_cpu, chunk_size, lower_bound)

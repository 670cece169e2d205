"""dplr-gen: ahead-of-time generated Triton kernels for the DPLR delta rule (RWKV-7).

``dplr_gen.chunk_rwkv7(...)`` and friends dispatch to the built spec under generated/ that covers the current
GPU (or, with TRITON_INTERPRET=1, runs on CPU tensors). The ops load lazily so that the CLI stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_OPS = (
    "chunk_dplr_delta_rule",
    "chunk_rwkv7",
    "fused_recurrent_dplr_delta_rule",
    "fused_recurrent_rwkv7",
    "fused_mul_recurrent_rwkv7",
)
__all__ = [*_OPS, "naive_dplr_delta_rule", "naive_rwkv7"]


def __getattr__(name: str) -> Any:
    if name in _OPS:
        from .runtime import dispatch

        return getattr(dispatch.default_package(), name)
    if name in ("naive_dplr_delta_rule", "naive_rwkv7"):
        from . import reference

        return getattr(reference, name)
    raise AttributeError(f"module 'dplr_gen' has no attribute {name!r}")

"""One variant's parameters and its readable name. Kept apart from variants.py (the spec enumeration): the
run-time path imports this, and nothing here pulls in pydantic, yaml or the quirk registry (cold start)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the head dims any variant may have: a spec-level limit, named here too for the run-time checks
from ..spec.limits import HEAD_DIM_MAX, HEAD_DIM_MIN  # noqa: F401


@dataclass(frozen=True)
class Variant:
    """One kernel family instance; its name spells out every parameter."""

    op: str
    dtype: str
    gate_dtype: str
    K: int
    V: int
    chunk_size: int | None  # None for the fused recurrent op
    varlen: bool
    gate_bound: float | None  # None: generic gate
    state_dtype: str
    dot_precision: str | None  # only for fp32

    @property
    def name(self) -> str:
        parts = [self.op, self.dtype, f"k{self.K}", f"v{self.V}"]
        if self.chunk_size is not None:
            parts.append(f"c{self.chunk_size}")
        parts.append("varlen" if self.varlen else "dense")
        parts.append("gany" if self.gate_bound is None else f"gb{_fmt_bound(self.gate_bound)}")
        parts.append(f"g{self.gate_dtype}")
        parts.append(f"s{self.state_dtype}")
        if self.dot_precision is not None:
            parts.append(self.dot_precision)
        return "_".join(parts)

    def params(self) -> dict[str, Any]:
        return {
            "op": self.op, "dtype": self.dtype, "gate_dtype": self.gate_dtype, "K": self.K, "V": self.V,
            "chunk_size": self.chunk_size, "varlen": self.varlen, "gate_bound": self.gate_bound,
            "state_dtype": self.state_dtype, "dot_precision": self.dot_precision,
        }


def _fmt_bound(x: float) -> str:
    # -0.6065 -> "m0p6065": a name-safe spelling that keeps every digit
    return ("m" if x < 0 else "") + repr(abs(x)).replace(".", "p")

"""The kernel plan of one fused recurrent build unit: its tiles, dtypes and its kernel's run-time arguments.

The fused recurrent template (dplr_gen/render/templates/fused_recurrent_dplr.py.jinja) renders from a
``FusedRecurrentPlan`` (its ``plan``) and the declaration ``KERNELS`` (layout rules: plan/kernel_args.py); the
driver (runtime/fused_recurrent_driver.py) reads the tile back from CONSTEXPRS and launches by the declared names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .kernel_args import Rows, arguments as _arguments, def_params, row, signatures_table as _table

if TYPE_CHECKING:  # the runtime imports this module (the kernel's name): no spec machinery at run time
    from ..spec.models import Knobs
    from .variant import Variant
    from .variants import BuildUnit

FWD = "fused_recurrent_dplr_fwd_kernel"
# one token per sequence (a decode step): the step without the loop over time, so that the state's load is in
# flight with the token's (H200, bf16, K = V = 64, H = 32, B = 512: 0.151 -> 0.144 ms a step)
STEP = "fused_recurrent_dplr_step_kernel"
_DTYPES = ("bf16", "fp16", "fp32")

KERNELS: dict[str, Rows] = {
    FWD: (row("q:io k:io v:io a:io b:io"), row("gk:gate o:io h0:*fp32 ht:*fp32 state_idx:*i32"),
          row("cu_seqlens:*i32", "varlen", own_line=True),
          row("scale:fp32 T:i32 H:i32 n_slots:i32 use_idx:i32 mul_ab:i32")),
    STEP: (row("q:io k:io v:io a:io b:io"), row("gk:gate o:io h0:*fp32 ht:*fp32 state_idx:*i32"),
           row("scale:fp32 H:i32 n_slots:i32 use_idx:i32 mul_ab:i32")),
}


@dataclass(frozen=True)
class FusedRecurrentPlan:
    """Every render-time decision of one fused recurrent unit; the template reads these as ``plan.<field>``."""

    # K tile: K padded to a power of two (each program holds all K rows of its state tile)
    block_k: int
    # V tile: the knob's (fused_recurrent.fwd.block_v), else V padded, at most 64 and so that the fp32 state tile
    # S[BK, BV] stays at 8192 elements (64 registers a thread at 4 warps): 64 up to K = 128, 32 above
    block_v: int
    # the decode step's V tile: knob fused_recurrent.step.block_v, else as block_v's default
    block_v_step: int
    # sequences given by cu_seqlens (the kernel then takes it)
    varlen: bool
    # signature types of the input/output tensors and of the gates
    io_type: str
    gate_type: str
    # warps, stages and registers of the launches (knobs fused_recurrent.fwd and fused_recurrent.step)
    knobs_fwd: Knobs
    knobs_step: Knobs


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def fused_recurrent_plan(unit: BuildUnit) -> FusedRecurrentPlan:
    """The plan of a fused recurrent build unit."""
    if unit.variant.op != "fused_recurrent":
        raise ValueError(f"fused_recurrent_plan: unit {unit.name} is a {unit.variant.op!r} unit; only "
                         "'fused_recurrent' units have a fused recurrent plan")
    return plan_fused_recurrent(unit.variant, unit.tune["fwd"], unit.tune.get("step"))


def plan_fused_recurrent(v: Variant, fwd: Knobs, step: Knobs | None = None) -> FusedRecurrentPlan:
    """The plan of a fused recurrent variant from its resolved knobs (``step``: the decode step's, else the
    forward's)."""
    if v.dtype not in _DTYPES:
        raise ValueError(f"plan_fused_recurrent: variant {v.name}: dtype {v.dtype!r}; valid: {list(_DTYPES)}")
    bk = next_pow2(v.K)
    default_bv = min(next_pow2(v.V), 64, 8192 // bk)
    step = fwd if step is None else step
    return FusedRecurrentPlan(
        block_k=bk,
        block_v=fwd.block_v or default_bv,
        block_v_step=step.block_v or default_bv,
        varlen=bool(v.varlen),
        io_type=v.dtype,
        gate_type=v.gate_dtype,
        knobs_fwd=fwd,
        knobs_step=step,
    )


def conditions(plan: FusedRecurrentPlan) -> dict[str, bool]:
    """Which conditional rows a unit's kernel takes."""
    return {"varlen": plan.varlen}


def arguments(kernel: str, plan: FusedRecurrentPlan) -> dict[str, str]:
    """``kernel``'s run-time arguments in order, name -> signature type."""
    return _arguments(KERNELS[kernel], conditions(plan), plan)


def kernel_params(kernel: str, plan: FusedRecurrentPlan) -> str:
    """The run-time parameter lines of ``kernel``'s def (4-space indented, no final newline)."""
    return def_params(KERNELS[kernel], conditions(plan))


def signatures_table(plan: FusedRecurrentPlan) -> str:
    """The SIGNATURES table of a unit's kernels (no final newline)."""
    return _table(KERNELS, conditions(plan), plan)

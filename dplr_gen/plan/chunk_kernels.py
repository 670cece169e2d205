"""The run-time arguments of the chunk kernels, declared once: names, order, types and the variants that take them.

The chunk template renders each kernel's parameter lines (``kernel_params``) and its SIGNATURES entry
(``signatures_table``, ``conditional_signatures``) from these rows (layout rules: plan/kernel_args.py); the driver
launches by these names in this order (runtime/chunk_driver._launch reads them back from SIGNATURES).
"""

from __future__ import annotations

from typing import Any

from .kernel_args import Rows, arguments as _arguments, def_params, row as _row, signature_lines
from .kernel_args import signatures_table as _table

PROMISE = _row("kept:*i32 lower_bound:fp32", "clamp")  # the caller's lower_bound promise (runtime/gate_check.py)
CU = _row("cu_seqlens:*i32", "varlen")
# the per-chunk form flags (1: the chunk's exponents allow the factored form): the backward's prep writes them for a
# split token pass (splits_token_pass), whose kernels each take the chunks whose flag equals their ``form``; both
# preps where they are split by chunk (knob chunk.prep.split_exact), whose exact kernels take the chunks flagged 0
FAC = _row("fac:*i32", "prep_flags")
CU_MAP = _row("cu_seqlens:*i32 chunk_map:*i32", "varlen")
TH = _row("T:i32 H:i32")
# what a state pass over segments takes besides the whole pass's arguments: the segment maps and chunks a segment
SEGMENT_ARGS = _row("xs:*fp32 seg_chunks:i32")

KERNELS: dict[str, Rows] = {
    "chunk_dplr_prep_kernel": (
        _row("q:io k:io a:io b:io gk:gate"), _row("w:io m:io bwt:io kwt:io egc:*fp32"), _row("aqk:io aqb:io qw:io"),
        _row("fac:*i32", "split_exact"), PROMISE, CU_MAP, TH),
    "chunk_dplr_fwd_kernel": (
        _row("qw:io kwt:io v:io bwt:io egc:*fp32"), _row("w:io m:io aqk:io aqb:io"),
        _row("o:io h0:*fp32 h:states ht:*fp32 u:io"), CU, _row("scale:fp32 store_states:i32 T:i32 H:i32")),
    "chunk_dplr_fwd_h_kernel": (
        _row("kwt:io v:io bwt:io egc:*fp32"), _row("w:io m:io h0:*fp32 h:states ht:*fp32 u:io"), CU, TH),
    "chunk_dplr_prep_bwd_kernel": (
        _row("q:io k:io a:io b:io gk:gate"), _row("w:io m:io bwt:io kwt:io egc:*fp32"),
        _row("y:io p:io qwt:io awt:io"), _row("aqkt:io aakt:io store_pass_ops:i32"),
        _row("aqk:io aqb:io qw:io store_fwd_ops:i32"), FAC, PROMISE, CU_MAP, TH),
    "chunk_dplr_bwd_dh_kernel": (
        _row("qwt:io awt:io egc:*fp32 y:io p:io"), _row("kwt:io aqkt:io aakt:io"),
        _row("do:io dht:*fp32 dh:states dh0:*fp32 dr:io"), _row("dv:io"), CU, _row("scale:fp32 T:i32 H:i32")),
    "chunk_dplr_bwd_kernel": (
        _row("q:io k:io v:io a:io b:io"), _row("gk:gate h:states dh:states u:io dr:io"), _row("do:io"),
        _row("dq:io dk:io da:io db:io"), _row("dg:gate"), _row("fac:*i32 form:i32", "split"),
        # the states the token pass derives: the backward prep's operands of the state steps
        _row("egc:*fp32 bwt:io kwt:io qwt:io awt:io", "derive", own_line=True),
        # n_items: the persistent Gluon kernel's count of work items (runtime/chunk_driver.persistent_launch)
        CU_MAP, _row("scale:fp32 T:i32 H:i32 n_items:i32@gluon")),
}


def _with_segments(kernel: str, after: str) -> Rows:
    """``kernel``'s rows with SEGMENT_ARGS after the row ending in its argument ``after``: its pass over segments."""
    rows = KERNELS[kernel]
    i = next(i for i, r in enumerate(rows) if r.args[-1][0] == after)
    return (*rows[:i + 1], SEGMENT_ARGS, *rows[i + 1:])


# the small-grid state passes over segments (dense variants only) and the kernels writing the segments' maps,
# each with the condition under which a unit has it: the forward's and the states-only pass ("segments"), the
# reverse pass ("segments_bwd")
SEGMENT_KERNELS: dict[str, tuple[str, Rows]] = {
    "chunk_dplr_seg_maps_kernel": (
        "segments", (_row("kwt:io v:io bwt:io egc:*fp32 w:io m:io"), _row("xs:*fp32 seg_chunks:i32 T:i32 H:i32"))),
    "chunk_dplr_fwd_seg_kernel": ("segments", _with_segments("chunk_dplr_fwd_kernel", "u")),
    "chunk_dplr_fwd_h_seg_kernel": ("segments", _with_segments("chunk_dplr_fwd_h_kernel", "u")),
    # seg_first: the first segment whose map is written (the reverse pass needs every one but segment 0's)
    "chunk_dplr_seg_maps_bwd_kernel": (
        "segments_bwd", (_row("qwt:io awt:io egc:*fp32 y:io p:io"),
                         _row("do:io xs:*fp32 seg_chunks:i32 seg_first:i32 scale:fp32 T:i32 H:i32"))),
    "chunk_dplr_bwd_dh_seg_kernel": ("segments_bwd", _with_segments("chunk_dplr_bwd_dh_kernel", "dv")),
}
# the split token pass's second kernel: the Triton form, for the chunks the Gluon kernel cannot take
SPLIT_KERNELS: dict[str, tuple[str, Rows]] = {"chunk_dplr_bwd_triton_kernel": ("split", KERNELS["chunk_dplr_bwd_kernel"])}
# the preps' second kernels where they are split by chunk: the exact form for the chunks the first flagged 0,
# persistent (n_items: the (chunk slot, head) pairs)
EXACT_KERNELS: dict[str, tuple[str, Rows]] = {
    name.replace("_kernel", "_exact_kernel"): ("split_exact", (*KERNELS[name], _row("n_items:i32")))
    for name in ("chunk_dplr_prep_kernel", "chunk_dplr_prep_bwd_kernel")
}


def splits_token_pass(plan: Any, flags: Any) -> bool:
    """Whether a unit's token pass is split in two by chunk: the persistent Gluon kernel takes the chunks whose
    gates allow the factored form (flagged per chunk by the backward's prep), the Triton form the rest. Where the
    Gluon token pass is built for an any-gate variant (the Gluon kernel computes the factored form only)."""
    return bool(flags.gluon_token_pass) and not plan.factored


_CONDITIONAL = {**SEGMENT_KERNELS, **SPLIT_KERNELS, **EXACT_KERNELS}


def conditions(plan: Any, flags: Any) -> dict[str, bool]:
    """Which conditional rows and kernels a unit takes (its ChunkPlan and flags)."""
    split = splits_token_pass(plan, flags)
    return {"clamp": plan.clamp, "varlen": bool(plan.cu_args), "derive": plan.derive_states,
            "gluon": bool(flags.gluon_token_pass), "segments": plan.segments > 0,
            "segments_bwd": plan.segments_bwd > 0, "split": split, "split_exact": plan.split_exact,
            "prep_flags": split or plan.split_exact}


def _rows(kernel: str) -> Rows:
    if kernel in KERNELS:
        return KERNELS[kernel]
    if kernel in _CONDITIONAL:
        return _CONDITIONAL[kernel][1]
    raise KeyError(f"{kernel!r} is no declared chunk kernel; declared: {sorted([*KERNELS, *_CONDITIONAL])}")


def kernels(plan: Any, flags: Any) -> list[str]:
    """Every kernel a unit has, in its SIGNATURES order (the segmented ones after the small-grid copies)."""
    cond = conditions(plan, flags)
    return [*KERNELS, *(k for k, (when, _) in _CONDITIONAL.items() if cond[when])]


def arguments(kernel: str, plan: Any, flags: Any) -> dict[str, str]:
    """``kernel``'s run-time arguments in order, name -> signature type, for a unit (its ChunkPlan and flags)."""
    return _arguments(_rows(kernel), conditions(plan, flags), plan)


def kernel_params(kernel: str, plan: Any, flags: Any) -> str:
    """The run-time parameter lines of ``kernel``'s def (4-space indented, no final newline)."""
    return def_params(_rows(kernel), conditions(plan, flags))


def signatures_table(plan: Any, flags: Any) -> str:
    """The SIGNATURES table of a unit's kernels but the segmented ones (no final newline)."""
    return _table(KERNELS, conditions(plan, flags), plan)


def conditional_signatures(when: str, plan: Any, flags: Any) -> str:
    """The SIGNATURES entries of the conditional kernels under condition ``when`` (the segmented ones, the split
    token pass's second kernel, the split preps' exact kernels), as statements adding them to the table (no final
    newline)."""
    valid = sorted({w for w, _ in _CONDITIONAL.values()})
    if when not in valid:
        raise ValueError(f"conditional_signatures: condition {when!r}; valid: {', '.join(map(repr, valid))}")
    cond = conditions(plan, flags)
    out = []
    for kernel, (w, rows) in _CONDITIONAL.items():
        if w == when:
            out += [f'SIGNATURES["{kernel}"] = {{', *signature_lines(rows, cond, plan, " " * 4), "}"]
    return "\n".join(out)

"""The run-time arguments of the chunk kernels, declared once: names, order, types and the variants that take them.

The template renders each kernel's parameter lines (``kernel_params``) and its SIGNATURES table
(``signatures_table``, what the ahead-of-time compile and the loader read) from these rows. A row is one line of
the SIGNATURES table; the kernel's ``def`` puts the unconditional rows before the first conditional one on its first
line, each row marked ``own_line`` on a line of its own, and the rest on its last line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# argument kinds -> signature types: "io" a tensor of the input dtype, "gate" of the gate dtype, "states" of the
# chunk-boundary states' dtype (ChunkPlan.states_type); the rest as written
_POINTER_OF = {"io": "io_type", "gate": "gate_type", "states": "states_type"}


@dataclass(frozen=True)
class Row:
    """Arguments (name, kind, condition) on one SIGNATURES line, the row taken where condition ``when`` holds
    (None: always), each argument where its own does."""

    args: tuple[tuple[str, str, str | None], ...]
    when: str | None = None  # "clamp", "varlen", "derive" or "gluon" (Conditions)
    own_line: bool = False  # in the def, a line of its own (else inline in the def's last line)


def _row(spec: str, when: str | None = None, own_line: bool = False) -> Row:
    """A row from "name:kind name:kind@condition ..."."""
    args = []
    for arg in spec.split():
        name, _, kind = arg.partition(":")
        kind, _, cond = kind.partition("@")
        args.append((name, kind, cond or None))
    return Row(tuple(args), when, own_line)


PROMISE = _row("kept:*i32 lower_bound:fp32", "clamp")  # the caller's lower_bound promise (runtime/gate_check.py)
CU = _row("cu_seqlens:*i32", "varlen")
CU_MAP = _row("cu_seqlens:*i32 chunk_map:*i32", "varlen")
TH = _row("T:i32 H:i32")

KERNELS: dict[str, tuple[Row, ...]] = {
    "chunk_dplr_prep_kernel": (
        _row("q:io k:io a:io b:io gk:gate"), _row("w:io m:io bwt:io kwt:io egc:*fp32"), _row("aqk:io aqb:io qw:io"),
        PROMISE, CU_MAP, TH),
    "chunk_dplr_fwd_kernel": (
        _row("qw:io kwt:io v:io bwt:io egc:*fp32"), _row("w:io m:io aqk:io aqb:io"),
        _row("o:io h0:*fp32 h:states ht:*fp32 u:io"), CU, _row("scale:fp32 store_states:i32 T:i32 H:i32")),
    "chunk_dplr_fwd_h_kernel": (
        _row("kwt:io v:io bwt:io egc:*fp32"), _row("w:io m:io h0:*fp32 h:states ht:*fp32 u:io"), CU, TH),
    "chunk_dplr_prep_bwd_kernel": (
        _row("q:io k:io a:io b:io gk:gate"), _row("w:io m:io bwt:io kwt:io egc:*fp32"),
        _row("y:io p:io qwt:io awt:io"), _row("aqkt:io aakt:io store_pass_ops:i32"),
        _row("aqk:io aqb:io qw:io store_fwd_ops:i32"), PROMISE, CU_MAP, TH),
    "chunk_dplr_bwd_dh_kernel": (
        _row("qwt:io awt:io egc:*fp32 y:io p:io"), _row("kwt:io aqkt:io aakt:io"),
        _row("do:io dht:*fp32 dh:states dh0:*fp32 dr:io"), _row("dv:io"), CU, _row("scale:fp32 T:i32 H:i32")),
    "chunk_dplr_bwd_kernel": (
        _row("q:io k:io v:io a:io b:io"), _row("gk:gate h:states dh:states u:io dr:io"), _row("do:io"),
        _row("dq:io dk:io da:io db:io"), _row("dg:gate"),
        # the states the token pass derives: the backward prep's operands of the state steps
        _row("egc:*fp32 bwt:io kwt:io qwt:io awt:io", "derive", own_line=True),
        # n_items: the persistent Gluon kernel's count of work items (runtime/chunk_driver.persistent_launch)
        CU_MAP, _row("scale:fp32 T:i32 H:i32 n_items:i32@gluon")),
}


def conditions(plan: Any, flags: Any) -> dict[str, bool]:
    """Which conditional rows a unit's kernels take (its ChunkPlan and flags)."""
    return {"clamp": plan.clamp, "varlen": bool(plan.cu_args), "derive": plan.derive_states,
            "gluon": bool(flags.gluon_token_pass)}


def _taken(rows: tuple[Row, ...], cond: Mapping[str, bool]) -> list[Row]:
    """The rows a unit takes."""
    return [r for r in rows if r.when is None or cond[r.when]]


def _args(row: Row, cond: Mapping[str, bool]) -> list[tuple[str, str]]:
    """(name, kind) of the arguments of ``row`` a unit takes."""
    return [(n, k) for n, k, c in row.args if c is None or cond[c]]


def _names(row: Row, cond: Mapping[str, bool]) -> list[str]:
    return [n for n, _ in _args(row, cond)]


def arguments(kernel: str, plan: Any, flags: Any) -> dict[str, str]:
    """``kernel``'s run-time arguments in order, name -> signature type, for a unit (its ChunkPlan and flags)."""
    cond = conditions(plan, flags)
    return {n: _type(k, plan) for r in _taken(KERNELS[kernel], cond) for n, k in _args(r, cond)}


def _type(kind: str, plan: Any) -> str:
    return f"*{getattr(plan, _POINTER_OF[kind])}" if kind in _POINTER_OF else kind


def kernel_params(kernel: str, plan: Any, flags: Any) -> str:
    """The run-time parameter lines of ``kernel``'s def (4-space indented, no final newline)."""
    cond = conditions(plan, flags)
    rows = KERNELS[kernel]
    first = next(i for i, r in enumerate(rows) if r.when is not None)
    lines = [", ".join(n for r in rows[:first] for n in _names(r, cond)) + ","]
    rest = _taken(rows[first:], cond)
    lines += [", ".join(_names(r, cond)) + "," for r in rest if r.own_line]
    lines.append(" ".join(n + "," for r in rest if not r.own_line for n in _names(r, cond)))
    return "\n".join("    " + line for line in lines)


def signatures_table(plan: Any, flags: Any) -> str:
    """The SIGNATURES table of a unit's kernels (no final newline)."""
    cond = conditions(plan, flags)
    out = ["SIGNATURES = {"]
    for kernel in KERNELS:
        out.append(f'    "{kernel}": {{')
        out += ["        " + " ".join(f'"{n}": "{_type(k, plan)}",' for n, k in _args(r, cond))
                for r in _taken(KERNELS[kernel], cond)]
        out.append("    },")
    out.append("}")
    return "\n".join(out)

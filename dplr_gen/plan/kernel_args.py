"""Kernels' run-time arguments declared as rows, and the text the templates render from them.

A kernel is declared once as a tuple of rows (``plan/chunk_kernels.py``, ``plan/fused_recurrent_plan.py``); its
``def`` parameter lines (``def_params``), its SIGNATURES entry (``signature_lines``: what the ahead-of-time compile
and the loader read, and the order the drivers launch in) and its arguments (``arguments``) all come from them.
A row is one line of the SIGNATURES entry. In the ``def``, the unconditional rows before the first conditional one
go on its first line, each row marked ``own_line`` on a line of its own, and the rest on its last line; a kernel
without conditional rows has one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# argument kinds -> the plan field holding their signature type: "io" a tensor of the input dtype, "gate" of the
# gate dtype, "states" of the chunk-boundary states' dtype (ChunkPlan.states_type); other kinds are written as is
_POINTER_OF = {"io": "io_type", "gate": "gate_type", "states": "states_type"}


@dataclass(frozen=True)
class Row:
    """Arguments (name, kind, condition) on one SIGNATURES line, the row taken where condition ``when`` holds
    (None: always), each argument where its own does."""

    args: tuple[tuple[str, str, str | None], ...]
    when: str | None = None  # a condition name (the declaring module's ``conditions``)
    own_line: bool = False  # in the def, a line of its own (else inline in the def's last line)


Rows = tuple[Row, ...]


def row(spec: str, when: str | None = None, own_line: bool = False) -> Row:
    """A row from "name:kind name:kind@condition ..."."""
    args = []
    for arg in spec.split():
        name, _, kind = arg.partition(":")
        kind, _, cond = kind.partition("@")
        args.append((name, kind, cond or None))
    return Row(tuple(args), when, own_line)


def taken(rows: Rows, cond: Mapping[str, bool]) -> list[Row]:
    """The rows a unit takes."""
    return [r for r in rows if r.when is None or cond[r.when]]


def row_args(r: Row, cond: Mapping[str, bool]) -> list[tuple[str, str]]:
    """(name, kind) of the arguments of row ``r`` a unit takes."""
    return [(n, k) for n, k, c in r.args if c is None or cond[c]]


def signature_type(kind: str, plan: Any) -> str:
    """An argument kind's signature type in a unit (its plan holds the dtypes)."""
    return f"*{getattr(plan, _POINTER_OF[kind])}" if kind in _POINTER_OF else kind


def arguments(rows: Rows, cond: Mapping[str, bool], plan: Any) -> dict[str, str]:
    """A kernel's run-time arguments in order, name -> signature type."""
    return {n: signature_type(k, plan) for r in taken(rows, cond) for n, k in row_args(r, cond)}


def def_params(rows: Rows, cond: Mapping[str, bool]) -> str:
    """The run-time parameter lines of a kernel's def (4-space indented, no final newline)."""
    first = next((i for i, r in enumerate(rows) if r.when is not None), len(rows))

    def names(r: Row) -> list[str]:
        return [n for n, _ in row_args(r, cond)]

    lines = [", ".join(n for r in rows[:first] for n in names(r)) + ","]
    # the conditional rows in their declared order (the order SIGNATURES has): an own_line row on a line of its
    # own, the others run together
    run: list[str] = []
    for r in taken(rows[first:], cond):
        if r.own_line:
            lines += [" ".join(run)] if run else []
            lines.append(", ".join(names(r)) + ",")
            run = []
        else:
            run += [n + "," for n in names(r)]
    lines += [" ".join(run)] if run else []
    return "\n".join("    " + line for line in lines)


def signature_lines(rows: Rows, cond: Mapping[str, bool], plan: Any, indent: str) -> list[str]:
    """The lines inside a kernel's SIGNATURES entry, one a row taken."""
    return [indent + " ".join(f'"{n}": "{signature_type(k, plan)}",' for n, k in row_args(r, cond))
            for r in taken(rows, cond)]


def signatures_table(declared: Mapping[str, Rows], cond: Mapping[str, bool], plan: Any) -> str:
    """A SIGNATURES table literal of the ``declared`` kernels, in their order (no final newline)."""
    out = ["SIGNATURES = {"]
    for kernel, rows in declared.items():
        out += [f'    "{kernel}": {{', *signature_lines(rows, cond, plan, " " * 8), "    },"]
    out.append("}")
    return "\n".join(out)

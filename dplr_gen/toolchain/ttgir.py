"""Reading Triton's TTGIR text: layout aliases and the conversions into or out of MMA layouts."""

from __future__ import annotations

import functools
import re
from typing import Mapping

_ALIAS_RE = re.compile(r"^(#[\w.$-]+)\s*=\s*(.+?)\s*$")
_ALIAS_USE_RE = re.compile(r"#[A-Za-z_][\w$-]*(?![\w.<])")


def _match_close(s: str, start: int) -> int:
    """Index of the bracket closing the one at ``s[start]`` (nesting of <>, {}, (), [] and strings)."""
    pairs = {"<": ">", "{": "}", "(": ")", "[": "]"}
    stack: list[str] = []
    i = start
    in_str = False
    while i < len(s):
        c = s[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
        elif c == ">" and s[i - 1] == "-":  # "->" inside an attribute is not a bracket
            pass
        i += 1
    return -1


def _split_top(s: str) -> list[str]:
    """Split on commas that are not nested in brackets."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "<{([":
            depth += 1
        elif c in ">})]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _tensor_encoding(s: str, start: int) -> tuple[str | None, int]:
    """Encoding of the first ``tensor<...>`` at or after ``start``; returns (encoding, end index)."""
    i = s.find("tensor<", start)
    if i < 0:
        return None, -1
    j = _match_close(s, i + len("tensor"))
    if j < 0:
        return None, -1
    parts = _split_top(s[i + len("tensor<"):j])
    return (parts[1] if len(parts) > 1 else None), j + 1


def ttgir_aliases(ttgir: str) -> dict[str, str]:
    """The ``#name = <attribute>`` definitions at the top of a TTGIR module, nested aliases resolved."""
    raw: dict[str, str] = {}
    for line in ttgir.splitlines():
        m = _ALIAS_RE.match(line)
        if m and not m.group(1).startswith("#loc"):
            raw[m.group(1)] = m.group(2)

    @functools.lru_cache(maxsize=None)
    def resolve(name: str, depth: int = 0) -> str:
        body = raw[name]
        if depth > 8:
            return body
        return _ALIAS_USE_RE.sub(lambda m: resolve(m.group(0), depth + 1) if m.group(0) in raw else m.group(0), body)

    return {k: resolve(k) for k in raw}


def _resolve(enc: str, aliases: Mapping[str, str]) -> str:
    return _ALIAS_USE_RE.sub(lambda m: aliases.get(m.group(0), m.group(0)), enc)


def _is_mma(enc: str, raw_enc: str) -> bool:
    # "#ttg.nvidia_mma<" (3.3+), "#triton_gpu.nvidia_mma<" (3.1/3.2); an unresolved "#mma" alias counts too
    # the encoding itself, not one nesting it (a dot_op whose parent is an mma is not an mma)
    return bool(re.match(r"#[\w.]*nvidia_mma<", enc.strip())) or bool(re.fullmatch(r"#mma\d*", raw_enc.strip()))


def _dot_op_parent(enc: str) -> str | None:
    """Parent encoding of a (resolved) ``dot_op<{... parent = X ...}>`` encoding, else None."""
    m = re.search(r"\.dot_op<", enc)
    if not m:
        return None
    j = _match_close(enc, m.end() - 1)
    body = enc[m.end():j].strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    for part in _split_top(body):
        k, _, v = part.partition("=")
        if k.strip() == "parent":
            return v.strip()
    return None


def mma_conversions(ttgir: str, *, include_dot_operands: bool = False) -> list[str]:
    """Lines of ``ttgir`` holding a ``convert_layout`` between two DIFFERENT nvidia_mma encodings.

    Aliases (``#mma``, ``#mma1``...) are resolved to their full definitions before comparing. This is the
    conversion Triton 3.0/3.1 abort on ("mma -> mma layout conversion is only supported on Ampere").
    ``include_dot_operands`` also flags mma -> ``dot_op`` whose parent is a different mma encoding (a
    dot result fed as operand to a dot of another layout), which 3.6 emits for chained dots at 8 warps.
    """
    aliases = ttgir_aliases(ttgir)
    found = []
    for line in ttgir.splitlines():
        k = line.find("convert_layout")
        if k < 0:
            continue
        colon = line.find(" : ", k)
        if colon < 0:
            continue
        src_raw, end = _tensor_encoding(line, colon)
        if src_raw is None:
            continue
        arrow = line.find("->", end)
        dst_raw, _ = _tensor_encoding(line, arrow) if arrow >= 0 else (None, -1)
        if dst_raw is None:
            continue
        src, dst = _resolve(src_raw, aliases), _resolve(dst_raw, aliases)
        if not _is_mma(src, src_raw):
            continue
        if _is_mma(dst, dst_raw):
            if src != dst:
                found.append(line.strip())
        elif include_dot_operands:
            parent = _dot_op_parent(dst)
            if parent is not None and _is_mma(parent, parent) and parent != src:
                found.append(line.strip())
    return found

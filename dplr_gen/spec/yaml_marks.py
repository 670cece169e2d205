"""YAML loaded together with where each value stands, so that errors can say file:line:column."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Loc = tuple[int | str, ...]


@dataclass(frozen=True)
class Mark:
    line: int  # 1-based, as editors count
    column: int

    @classmethod
    def of(cls, m: yaml.Mark) -> "Mark":
        return cls(m.line + 1, m.column + 1)


class YAMLSyntaxError(ValueError):
    """Not valid YAML; the message is ``file:line:column: problem``."""


@dataclass
class Marked:
    data: Any
    values: dict[Loc, Mark]  # path (keys and list indices, as pydantic's loc) -> where its value starts
    keys: dict[Loc, Mark]  # path of a mapping entry -> where its key stands

    def where(self, loc: Loc, key: bool = False) -> Mark | None:
        """Where ``loc``'s key (``key``) or value stands; for a path the file lacks (a missing key), its longest
        prefix that it has."""
        if key and loc in self.keys:
            return self.keys[loc]
        for n in range(len(loc), -1, -1):
            if tuple(loc[:n]) in self.values:
                return self.values[tuple(loc[:n])]
        return None

    def present(self, loc: Loc) -> Loc:
        """The longest prefix of ``loc`` that the file has a value at (beyond it: keys the file lacks, or the
        members of a union that pydantic tried)."""
        n = len(loc)
        while n and tuple(loc[:n]) not in self.values:
            n -= 1
        return tuple(loc[:n])


def load(path: Path) -> Marked:
    """Parse ``path`` (safe constructors only); syntax errors name the file, line and column."""
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = "; ".join(x for x in (e.context, e.problem) if x)
        raise YAMLSyntaxError(f"{where}: not valid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise YAMLSyntaxError(f"{path}: not valid YAML: {e}") from None
    marked = Marked(data, {}, {})
    if node is not None:
        _walk(node, (), marked)
    return marked


def _walk(node: yaml.Node, loc: Loc, out: Marked) -> None:
    out.values[loc] = Mark.of(node.start_mark)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            if isinstance(k, yaml.ScalarNode) and k.tag.endswith(":int"):
                key = int(key)
            out.keys[(*loc, key)] = Mark.of(k.start_mark)
            _walk(v, (*loc, key), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*loc, i), out)

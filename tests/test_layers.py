"""The package's layers run one way: spec -> plan -> render -> toolchain -> runtime -> (cp, integrations, cli, tools).

Every import of every module under dplr_gen/ (module level, inside functions, under TYPE_CHECKING: all of them
are dependencies) is read with ast and resolved to a module of the package; none may go from a layer to a higher
one, and no two modules may import each other, directly or around a loop. A new top-level module or subpackage
fails the test until it is given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dplr_gen"

# the layer of each top-level module or subpackage of dplr_gen ("" is the package's own __init__: the lazy
# facade over the runtime's ops, imported by nothing below it)
SPEC, PLAN, RENDER, TOOLCHAIN, RUNTIME, TOP = range(6)
LAYERS: dict[str, int] = {
    "spec": SPEC,            # spec models, arch profiles, quirk registry: data
    "plan": PLAN,            # variants and each unit's tiles, passes and kernel arguments
    "render": RENDER,        # Triton source from the templates
    "toolchain": TOOLCHAIN,  # Triton's compiler, the cache, the build of a package
    "runtime": RUNTIME,      # loading kernels, dispatch, the ops and their drivers
    "reference": RUNTIME,    # the float64 reference of the ops (plain torch)
    "cp": TOP,               # context parallelism over the ops
    "integrations": TOP,     # other libraries routed to the ops (fla)
    "cli": TOP,
    "tools": TOP,            # compat matrix, docs, sources
    "testing": TOP,          # inputs and error measures for tests and scripts
    "": TOP,
}
LAYER_NAMES = ("spec", "plan", "render", "toolchain", "runtime", "top (cp, integrations, cli, tools)")


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (file ``path``) imports anywhere in its body."""
    package = name.split(".")[0]
    base_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base_parts[:len(base_parts) - (node.level - 1)]
                if len(up) < 1:
                    raise AssertionError(f"{path}: relative import above the package")
                mod = ".".join(up + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from a import b`: b is a module where one exists, else a name in a
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            if t.split(".")[0] != package:
                continue
            while t not in known:  # an attribute of a module (import a.b.c where c is not a module)
                t = t.rsplit(".", 1)[0]
            if t != name:
                found.add(t)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_of(module: str, layers: dict[str, int]) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top not in layers:
        raise KeyError(top)
    return layers[top]


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Each import from a module to one of a higher layer, in words."""
    return [f"{src} ({LAYER_NAMES[layer_of(src, layers)]}) imports {dst} ({LAYER_NAMES[layer_of(dst, layers)]})"
            for src, dsts in sorted(graph.items()) for dst in sorted(dsts)
            if layer_of(dst, layers) > layer_of(src, layers)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_every_top_level_module_has_a_layer() -> None:
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops | {""} == set(LAYERS), f"give these a layer in LAYERS: {sorted(tops - set(LAYERS))}; " \
                                       f"gone: {sorted(set(LAYERS) - tops - {''})}"


def test_the_parser_sees_the_imports(graph: dict[str, set[str]]) -> None:
    """Imports of each kind are found: module level, relative, inside a function, ``from x import module``."""
    assert "dplr_gen.runtime.ops" in graph["dplr_gen.runtime.dispatch"]        # from . import ops
    assert "dplr_gen.runtime.loader" in graph["dplr_gen.runtime.dispatch"]     # from .loader import ...
    assert "dplr_gen.runtime.dispatch" in graph["dplr_gen"]                    # inside __getattr__
    assert "dplr_gen.toolchain.cache" in graph["dplr_gen.toolchain.build"]     # from . import cache
    assert "dplr_gen.runtime.chunk_api" in graph["dplr_gen.cp"]
    assert "dplr_gen" in graph["dplr_gen.integrations.fla"]                    # the ops it routes to


def test_no_import_goes_up_a_layer(graph: dict[str, set[str]]) -> None:
    assert upward_imports(graph, LAYERS) == []


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_checks_find_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """On a package made for it: a spec module importing the runtime, and two runtime modules importing each
    other (one inside a function, one relatively)."""
    pkg = tmp_path / "dplr_gen"
    for d in ("spec", "runtime"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "spec" / "models.py").write_text("from ..runtime import ops\n")
    (pkg / "runtime" / "ops.py").write_text("def f():\n    from . import loader\n")
    (pkg / "runtime" / "loader.py").write_text("from dplr_gen.runtime.ops import f\n")
    g = import_graph(pkg)
    assert upward_imports(g, LAYERS) == ["dplr_gen.spec.models (spec) imports dplr_gen.runtime.ops (runtime)"]
    assert cycles(g) == [["dplr_gen.runtime.loader", "dplr_gen.runtime.ops"]]

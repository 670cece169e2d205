"""Shared test helpers: render a spec into a private package, run ops, compare with the float64 reference."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from dplr_gen.plan.variants import BuildUnit, build_units
from dplr_gen.render.render import render_unit
from dplr_gen.spec.models import load_spec
from dplr_gen.toolchain import build as b
from dplr_gen.toolchain.compile import import_source
from dplr_gen.reference import naive_dplr_delta_rule
from dplr_gen.runtime.loader import SpecPackage, package_at
from dplr_gen.testing import rel_err


def render_package(tmp_root: Path, spec_text: str, name: str) -> SpecPackage:
    """Render (no compile: the interpreter runs the source) a spec into tmp_root/<name>/."""
    spec = tmp_root / f"{name}.yaml"
    spec.write_text(spec_text)
    p = b.plan(spec, tmp_root)
    b.write_package(p)
    return package_at(p.out_dir)


SPECS = Path(__file__).resolve().parent.parent / "specs"


def spec_units(spec: str) -> list[BuildUnit]:
    """The build units of specs/<spec> for Triton 3.6.0."""
    units, _ = build_units(load_spec(SPECS / spec), Version("3.6.0"))
    return units


def rendered_module(unit: BuildUnit, folder: Path) -> dict[str, Any]:
    """A unit's rendered module's names, imported from a file (Gluon kernels read their source file)."""
    path = folder / f"{unit.name}.py"
    path.write_text(render_unit(unit))
    name = f"_rendered_test_{unit.name}"
    try:
        return dict(vars(import_source(path, name)))
    finally:
        sys.modules.pop(name, None)


def poison_(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan"))


def reference_with_grads(
    inputs: dict[str, Any], scale: float | None, cu_seqlens: torch.Tensor | None, do: torch.Tensor,
    dht: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """float64 forward and the gradients of <o, do> + <ht, dht> w.r.t. every input."""
    x64 = {n: t.detach().double().requires_grad_(True) for n, t in inputs.items() if t is not None}
    o, ht = naive_dplr_delta_rule(**x64, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens)
    loss = (o * do.double()).sum() + (ht * dht.double()).sum()
    names = list(x64)
    grads = torch.autograd.grad(loss, [x64[n] for n in names])
    return o.detach(), ht.detach(), dict(zip(names, grads))


def fwd_bwd_errors(op: Any, x: dict[str, Any], scale: float | None = None, **kw: Any) -> dict[str, float]:
    """``op(**x, output_final_state=True, **kw)`` forward and backward (of <o, do> + <ht, dht>, random do and dht)
    against the float64 reference: the relative error of o, the final state and every input's gradient."""
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, ht = op(**xs, scale=scale, output_final_state=True, **kw)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    ro, rht, rg = reference_with_grads(x, scale, kw.get("cu_seqlens"), do, dht)
    return {"o": rel_err(o, ro), "ht": rel_err(ht, rht), **{n: rel_err(xs[n].grad, rg[n]) for n in xs}}

"""What the quirk registry changes in the rendered source for old Triton releases, and that those forms compute
what the current ones do (Triton's interpreter runs either source)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from packaging.version import Version

from dplr_gen.runtime import ops
from dplr_gen.runtime.loader import package_at
from dplr_gen.spec import quirks as qr
from dplr_gen.spec.arch import load_arches
from dplr_gen.testing import rel_err, rwkv7_inputs
from dplr_gen.toolchain import build as b

from .helpers import reference_with_grads

SPEC = """
name: old_release_forms
targets: [sm_80, sm_90]
variants:
  - ops: [chunk]
    dtypes: [fp16, bf16]
    head_dims: [32]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [null]
"""


def test_every_flag_a_quirk_sets_is_a_template_flag() -> None:
    """A misspelt flag in the registry would switch no workaround on: each must be one the arches know."""
    known = set(next(iter(load_arches().values())).base_flags())
    for q in qr.load_quirks():
        assert set(q.avoid.flags) <= known, (q.id, sorted(set(q.avoid.flags) - known))


def _package(tmp: Path, version: str):  # type: ignore[no-untyped-def]
    spec = tmp / "old_release_forms.yaml"
    spec.write_text(SPEC)
    p = b.plan(spec, tmp / f"t{version}", triton_version=Version(version))
    b.write_package(p)
    return p, package_at(p.out_dir)


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("old")
    return {v: _package(tmp, v) for v in ("3.1.0", "3.2.0", "3.6.0")}


def _sources(plan, name_part: str) -> list[str]:  # type: ignore[no-untyped-def]
    """The rendered sources of the units whose file name holds ``name_part``, one per target."""
    rels = [r for r in plan.unit_files.values() if name_part in r]
    assert len(rels) == 2, rels  # sm_80 and sm_90
    return [plan.files[r] for r in rels]


@pytest.mark.parametrize("version, split", [("3.1.0", True), ("3.2.0", True), ("3.6.0", False)])
def test_fp16_any_gate_prep_dots_split_on_old_releases_only(packages: dict, version: str, split: bool) -> None:
    """Triton 3.1 and 3.2 abort on sm_80 to sm_90 compiling the fp16 any-gate prep's tf32x3 dots (quirk
    tf32x3-branch-abort-old-triton): there the preps' products are three tf32 dots over split operands, and the
    other kernels keep the native form; bf16 variants (tf32 dots) and newer releases render as before."""
    plan, _ = packages[version]
    for fp16, bf16 in zip(_sources(plan, "chunk_fp16_"), _sources(plan, "chunk_bf16_")):
        assert ("return _dot_tf32x3(" in fp16) == split
        assert ("tf32x3-branch-abort-old-triton" in fp16.splitlines()[1]) == split  # the header names the quirk
        assert "_dot_tf32x3" not in bf16
        # the token pass and the state passes keep tl.dot with input_precision=PREC
        assert "def _dot(x, y):\n    return tl.dot(x, y, input_precision=PREC)" in fp16


def test_split_form_computes_what_the_native_form_does(packages: dict) -> None:
    """The fp16 any-gate variant as rendered for Triton 3.1 and for 3.6, forward and every gradient, against
    the float64 reference and against each other (the interpreter runs both sources)."""
    x = rwkv7_inputs(1, 40, 2, 32, dtype=torch.float16)
    x["gk"][:, 7] = -40.0  # a steep gate: that chunk takes the exact form, the others the factored one
    do = torch.randn(1, 40, 2, 32, dtype=torch.float16)
    dht = torch.randn(1, 2, 32, 32)
    got = {}
    for version in ("3.1.0", "3.6.0"):
        _, pkg = packages[version]
        xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        o, ht = ops.chunk_dplr_delta_rule(**xs, output_final_state=True, package=pkg)
        torch.autograd.backward((o, ht), (do, dht))
        got[version] = {"o": o.detach(), "ht": ht.detach(), **{n: t.grad for n, t in xs.items()}}
    ro, rht, rg = reference_with_grads(x, None, None, do.float(), dht)
    ref = {"o": ro, "ht": rht, **rg}
    for name, r in ref.items():
        assert rel_err(got["3.1.0"][name], r) <= 3e-3, name
        assert rel_err(got["3.1.0"][name], got["3.6.0"][name]) <= 2e-3, name

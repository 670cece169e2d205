"""``dplr-gen compat``: cells from the registry and compiles, sampling, the generated table, and one real run
under the installed Triton (no environment is made, nothing is downloaded)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from packaging.version import Version
from typer.testing import CliRunner

from dplr_gen.tools import compat as c
from dplr_gen.toolchain.build import REPO_ROOT, installed_triton
from dplr_gen.toolchain.compile import CompileOutcome
from dplr_gen.spec.models import load_spec
from dplr_gen.plan.variants import build_units

TINY = """
name: tiny
targets: [{targets}]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp32]
    head_dims: [32, 64]
    varlen: [false, true]
"""


def _spec(tmp_path: Path, targets: str, name: str = "tiny") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(TINY.format(targets=targets).replace("name: tiny", f"name: {name}"))
    return p


def _synthetic() -> dict:
    built = c._cell("demo", "sm_90", "3.2.0")
    built.update(status="built", variants_total=4, variants_compiled=2, variants_skipped=2,
                 quirk_effects={"hopper-chained-dot-reshape-abort": 2, "hopper-transposed-dot-result-wrong": 0},
                 active=["hopper-chained-dot-reshape-abort", "hopper-transposed-dot-result-wrong"],
                 units=[{"unit": "u1__sm_90", "ok": True, "error": "", "seconds": 3.0, "kernels": []},
                        {"unit": "u2__sm_90", "ok": True, "error": "", "seconds": 4.0, "kernels": []}])
    failed = c._cell("demo", "sm_90", "3.6.0")
    failed.update(status="failed", variants_total=4, variants_compiled=1, variants_skipped=3,
                  error="u1__sm_90: the compiler aborted inside the compiler (SIGABRT)",
                  units=[{"unit": "u1__sm_90", "ok": False, "seconds": 1.0, "kernels": [],
                          "error": "the compiler aborted inside the compiler (SIGABRT)\nAllocation.cpp:42",
                          "flags": {"no_mma_chaining": True}, "tune": {"fwd": {"num_warps": 8}}}])
    refused = c._cell("demo", "sm_100", "3.2.0")
    refused.update(status="refused", refusal="Triton < 3.3 cannot target sm_100 [sm100-not-targetable]",
                   active=["sm100-not-targetable"])
    plain = c._cell("demo", "sm_100", "3.6.0")
    plain.update(status="built", variants_total=2, variants_compiled=2,
                 units=[{"unit": "u1__sm_100", "ok": True, "error": "", "seconds": 2.0, "kernels": []}])
    q = {"archs": [90], "triton": ">=3.2,<3.3", "pattern": "a | pattern", "effect": "abort",
         "reference": "https://example.org/1", "avoid": {"max_num_warps": 4}}
    return {
        "schema": 1, "command": "dplr-gen compat --sample --triton 3.2.0,3.6.0 --jobs 2",
        "generated_at": "2026-01-01 00:00 UTC", "wall_seconds": 12.0, "mode": "sample",
        "machine": {"platform": "Linux-x", "cpus": 2, "python": "3.11.0"}, "installed_triton": "3.6.0",
        "source": {"commit": "abc", "uncommitted": []}, "filters": {"targets": None, "ops": None},
        "versions": [
            {"version": "3.2.0", "env": "own venv", "error": None, "units_compiled": 2, "units_failed": 0,
             "kernels": 2, "unit_seconds": 7.0, "kernel_compile_seconds": 5.0,
             "slowest_kernel": {"unit": "u2__sm_90", "kernel": "k", "compile_s": 3.5}},
            {"version": "3.6.0", "env": "installed (this interpreter)", "error": None, "units_compiled": 2,
             "units_failed": 1, "kernels": 1, "unit_seconds": 3.0, "kernel_compile_seconds": 1.0,
             "slowest_kernel": None},
        ],
        "specs": [{"name": "demo", "file": "specs/demo.yaml", "targets": ["sm_90", "sm_100"],
                   "filtered": [["x", "a reason"], ["y", "a reason"]]}],
        "cells": [built, failed, refused, plain],
        "quirks": {"hopper-chained-dot-reshape-abort": q,
                   "hopper-transposed-dot-result-wrong": {**q, "effect": "miscompile", "avoid": {}},
                   "sm100-not-targetable": {**q, "archs": [100], "avoid": {"refuse": "Triton < 3.3 cannot"}}},
    }


def test_markdown_from_synthetic_result() -> None:
    data = _synthetic()
    md = c.render_markdown(data)
    assert md == c.render_markdown(json.loads(json.dumps(data)))  # only the JSON goes in
    lines = md.splitlines()
    assert "Do not edit" in md and "`dplr-gen compat --sample --triton 3.2.0,3.6.0 --jobs 2`" in md
    assert "2026-01-01 00:00 UTC" in md and "Linux-x" in md and "**sample**" in md
    assert "## demo (`specs/demo.yaml`)" in md
    assert "| arch | Triton 3.2.0 | Triton 3.6.0 |" in lines
    row90 = next(x for x in lines if x.startswith("| sm_90 |"))
    cells90 = [x.strip() for x in row90.split(" | ")]
    assert cells90[1] == ("built, quirks avoided: hopper-chained-dot-reshape-abort, "
                          "hopper-transposed-dot-result-wrong° (2/4 compiled, 2 skipped by sampling)")
    assert cells90[2].startswith("**FAILED** (1 of 1; 1/4 compiled, 3 skipped by sampling)")
    row100 = next(x for x in lines if x.startswith("| sm_100 |"))
    assert "refused: Triton < 3.3 cannot target sm_100 [sm100-not-targetable]" in row100
    assert row100.rstrip().endswith("built (2/2 compiled) |")
    # sections: failures with the unit's flags and the error, registry entries, refusals, timings
    assert "## Failures" in md and "Allocation.cpp:42" in md and "no_mma_chaining=True" in md
    assert "- **hopper-chained-dot-reshape-abort** (sm 90; Triton >=3.2,<3.3; abort): a \\| pattern." in md
    assert "Reference: https://example.org/1" in md
    assert "## Refusals" in md and "sm_100 x 3.2.0" in md
    assert "2 x \"a reason\"" in md
    assert any(x.startswith("| 3.2.0 | own venv | 2 | 0 | 2 |") and x.endswith("u2__sm_90: 4.0 s (ok) |") for x in lines)
    assert c.any_failed(data)


def test_sample_one_per_family_at_largest_head_dim() -> None:
    spec = load_spec(REPO_ROOT / "specs" / "ampere.yaml")
    units, _ = build_units(spec, Version("3.6.0"))
    chosen, skipped = c.sample_units(units)
    assert len(chosen) + len(skipped) == len(units)

    def family(u):  # type: ignore[no-untyped-def]
        return (u.target, u.variant.op, c.gate_mode(u), u.variant.dtype, u.variant.gate_dtype, u.variant.varlen)

    keys = [family(u) for u in chosen]
    assert len(keys) == len(set(keys))
    assert set(keys) == {family(u) for u in units}
    # sm_80, sm_86 x (chunk bounded, chunk generic, fused) x 3 dtypes x (dense, varlen), and the bounded chunk
    # reading gk in its own dtype: bf16, fp16 x (dense, varlen)
    assert len(chosen) == 2 * (3 * 3 * 2 + 2 * 2)
    assert {u.variant.gate_dtype for u in chosen} == {"fp32", "bf16", "fp16"}
    for u in chosen:
        assert u.variant.K == 128 and u.variant.V == 128, u.name
    assert c.sample_units(list(reversed(units)))[0] == list(reversed(chosen))  # order-independent choice


def test_pairwise_sample_covers_every_pair_with_fewer_families() -> None:
    spec = load_spec(REPO_ROOT / "specs" / "hopper.yaml")
    units, _ = build_units(spec, Version("3.1.0"))
    full, _ = c.sample_units(units)
    chosen, skipped = c.sample_units(units, pairwise=True)
    assert len(chosen) + len(skipped) == len(units)
    assert set(u.name for u in chosen) < set(u.name for u in full)
    # the chunk units, most of the compile time, drop by a third
    assert sum(u.variant.op == "chunk" for u in chosen) <= 2 / 3 * sum(u.variant.op == "chunk" for u in full)

    def group(u):  # type: ignore[no-untyped-def]
        return (u.target, u.variant.op, u.variant.dtype)

    def factors(u):  # type: ignore[no-untyped-def]
        gate = "own" if u.variant.gate_dtype == u.variant.dtype else "fp32"
        return {"mode": c.gate_mode(u), "varlen": u.variant.varlen, "gate": gate}

    # every (target, op, dtype, gate mode, varlen) of the sample is kept, one gate dtype each where the group
    # has both gate modes (else two families could not cover varlen x gate dtype: all are kept)
    coarse = {(*group(u), c.gate_mode(u), u.variant.varlen) for u in full}
    assert {(*group(u), c.gate_mode(u), u.variant.varlen) for u in chosen} == coarse
    two_modes = [u for u in chosen if len({c.gate_mode(x) for x in full if group(x) == group(u)}) == 2]
    kept = [(*group(u), c.gate_mode(u), u.variant.varlen) for u in two_modes]
    assert kept and len(kept) == len(set(kept))
    # within each group, every pair of two factors' values that the sample has, the pairwise sample has too
    for g in {group(u) for u in full}:
        have = [factors(u) for u in full if group(u) == g]
        got = [factors(u) for u in chosen if group(u) == g]
        for x, y in (("mode", "varlen"), ("mode", "gate"), ("varlen", "gate")):
            assert {(f[x], f[y]) for f in have} == {(f[x], f[y]) for f in got}, (g, x, y)
    # Hopper's 16-bit chunk variants read the gate in both dtypes, and keep both in the pairwise sample
    for dt in ("bf16", "fp16"):
        assert {u.variant.gate_dtype for u in chosen if u.variant.op == "chunk" and u.variant.dtype == dt} == {dt, "fp32"}


def test_default_versions_latest_patch_per_minor() -> None:
    avail = [Version(x) for x in "3.9.0 3.8.0 3.7.1 3.7.0 3.5.1 3.5.0 3.3.1 3.3.0 3.2.0 3.1.0 3.0.0 2.3.1 "
             "3.10.0rc1".split()]
    assert [str(v) for v in c.default_versions(avail)] == [
        "3.1.0", "3.2.0", "3.3.1", "3.5.1", "3.7.1", "3.8.0", "3.9.0"]
    assert c.parse_versions("3.2.0, 3.6.0,3.2.0") == [Version("3.2.0"), Version("3.6.0")]
    with pytest.raises(ValueError):
        c.parse_versions("3.x")


@pytest.fixture()
def fake_compile(monkeypatch: pytest.MonkeyPatch) -> list:
    """Compiles recorded, never run; every Triton 'environment' is this interpreter."""
    calls: list = []

    def fake(job, timeout=900.0, python=sys.executable):
        calls.append((job.target, job.triton_version, job.unit))
        if job.target == "sm_80" and job.triton_version == "3.2.0":
            return CompileOutcome(job.unit, job.target, False, error="the compiler aborted (SIGABRT)")
        return CompileOutcome(job.unit, job.target, True,
                              kernels=[{"kernel": "k", "shared": 0, "num_warps": 4, "compile_s": 0.1}])

    def no_venv(*a, **k):
        raise AssertionError("no environment may be made here")

    monkeypatch.setattr(c, "run_in_subprocess", fake)
    monkeypatch.setattr(c, "ensure_venv", no_venv)
    monkeypatch.setattr(c, "_child_triton", lambda py: "(checked)")
    return calls


def test_refusals_come_from_registry_without_compiling(tmp_path: Path, fake_compile: list) -> None:
    spec = _spec(tmp_path, "sm_100, sm_120")
    data = c.run(c.Options(specs=[spec], versions=[Version("3.1.0"), Version("3.2.0")], jobs=1,
                           pythons={"3.1.0": sys.executable, "3.2.0": sys.executable}))
    assert fake_compile == []
    cells = {(x["target"], x["triton"]): x for x in data["cells"]}
    assert {x["status"] for x in cells.values()} == {"refused"}
    assert "[sm100-not-targetable]" in cells[("sm_100", "3.2.0")]["refusal"]
    assert "[sm120-no-tensor-core-dot]" in cells[("sm_120", "3.2.0")]["refusal"]
    assert "[sm120-not-targetable-3.1]" in cells[("sm_120", "3.1.0")]["refusal"]
    assert all(v["python"] is None for v in data["versions"])  # nothing to compile: no environment asked for
    assert not c.any_failed(data)
    assert "refused: Triton < 3.3 cannot target sm_100" in c.render_markdown(data)


def test_cells_built_with_quirks_and_failed(tmp_path: Path, fake_compile: list,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"3.1.0": Version("3.1.0"), "3.2.0": Version("3.2.0")}
    checked = iter(["3.1.0", "3.2.0"])
    monkeypatch.setattr(c, "_child_triton", lambda py: next(checked))
    spec = _spec(tmp_path, "sm_80, sm_90, sm_100")
    partial: list = []
    data = c.run(c.Options(specs=[spec], versions=list(versions.values()), jobs=1,
                           pythons={k: sys.executable for k in versions}), checkpoint=partial.append)
    # after each unit but the last, a partial result that renders as an incomplete table
    assert len(partial) == 7 and not any(x["complete"] for x in partial) and data["complete"]
    assert any(x["status"] == "pending" for x in partial[0]["cells"])
    assert "INCOMPLETE" in c.render_markdown(partial[0]) and "not finished (0 of 2" in c.render_markdown(partial[0])
    assert "INCOMPLETE" not in c.render_markdown(data)
    cells = {(x["target"], x["triton"]): x for x in data["cells"]}
    assert not any(t == "sm_100" for t, _, _ in fake_compile)  # refused up front
    assert len(fake_compile) == 8  # sample: one unit per family (dense, varlen) x (sm_80, sm_90) x 2 releases
    assert cells[("sm_100", "3.1.0")]["status"] == "refused"
    # an abort is a FAILED cell, not an exception
    assert cells[("sm_80", "3.2.0")]["status"] == "failed" and "SIGABRT" in cells[("sm_80", "3.2.0")]["error"]
    h = cells[("sm_90", "3.1.0")]
    assert h["status"] == "built" and h["variants_compiled"] == 2 and h["variants_skipped"] == 2
    # the 3.1 entry caps warps (the spec's default is 4 already) and sets a flag sm_90 sets anyway: no change
    # (the chunk-backward entry caps a stage this fused-recurrent spec does not have: no change either)
    assert h["quirk_effects"] == {"hopper-mma-to-mma-abort": 0, "hopper-chunk-bwd-abort-old-triton": 0}
    assert "built, quirks avoided: hopper-chunk-bwd-abort-old-triton°, hopper-mma-to-mma-abort° " \
        "(2/4 compiled, 2 skipped by sampling)" in c.cell_text(h)
    assert c.any_failed(data)


def test_quirk_effect_counts_units_it_changes(tmp_path: Path) -> None:
    p = tmp_path / "w8.yaml"
    p.write_text("name: w8\ntargets: [sm_90]\nvariants:\n  - ops: [fused_recurrent]\n    dtypes: [bf16]\n"
                 "    head_dims: [64]\n    varlen: [true]\ntuning:\n  fused_recurrent.fwd: {num_warps: 8}\n")
    spec = load_spec(p)
    units, _ = build_units(spec, Version("3.1.0"))
    assert c.quirk_effects(spec, "sm_90", Version("3.1.0"), units) == {
        "hopper-mma-to-mma-abort": 1, "hopper-chunk-bwd-abort-old-triton": 0}


def test_quirk_effect_ignores_what_the_build_sets_itself(tmp_path: Path) -> None:
    """A unit the build gives the Gluon token pass (a flag set after the registry's) is not counted as changed by
    an entry whose workaround the flags already hold: hopper's any-gate K = 128 variant under Triton 3.6."""
    p = tmp_path / "g.yaml"
    p.write_text("name: g\ntargets: [sm_90]\nvariants:\n  - ops: [chunk]\n    dtypes: [bf16]\n    head_dims: [128]\n"
                 "    chunk_sizes: [16]\n    varlen: [false]\n    gate_bounds: [null]\n"
                 "tuning:\n  chunk.bwd: {num_warps: 4, block_v: 64, block_k: 64, states_every: 32, gluon: true}\n")
    spec = load_spec(p)
    units, _ = build_units(spec, Version("3.6.0"))
    assert [u.flags["gluon_token_pass"] for u in units] == [True]
    assert c.quirk_effects(spec, "sm_90", Version("3.6.0"), units) == {"hopper-cast-trans-dot-operand-wrong": 0}


@pytest.mark.skipif(installed_triton() is None, reason="needs an installed Triton")
def test_end_to_end_installed_triton(tmp_path: Path) -> None:
    """Real compiles (fused recurrent, fast) for sm_80 and sm_90 with the installed Triton, via the CLI."""
    from dplr_gen.cli import app

    tv = str(installed_triton())
    spec = _spec(tmp_path, "sm_80, sm_90", name="tiny_e2e")
    out = tmp_path / "docs"
    res = CliRunner().invoke(app, ["compat", "--triton", tv, "--specs", str(spec), "--out", str(out), "-j", "2"])
    assert res.exit_code == 0, res.output
    md = (out / "compat.md").read_text()
    data = json.loads((out / "compat.json").read_text())
    assert md == c.render_markdown(data)
    assert f"Generated by `dplr-gen compat --sample --triton {tv} --specs {spec} --jobs 2 --out {out}`" in md
    assert f"| arch | Triton {tv} |" in md
    row80 = next(x for x in md.splitlines() if x.startswith("| sm_80 |"))
    row90 = next(x for x in md.splitlines() if x.startswith("| sm_90 |"))
    assert "| built (2/4 compiled, 2 skipped by sampling) |" in row80
    assert "built" in row90 and "(2/4 compiled, 2 skipped by sampling)" in row90 and "FAILED" not in row90
    (cell80,) = [x for x in data["cells"] if x["target"] == "sm_80"]
    # one unit per family: the dense and the varlen one, each at the largest head dim
    assert sorted(u["variant"] for u in cell80["units"]) == [
        "fused_recurrent_fp32_k64_v64_dense_gany_gfp32_sfp32_ieee",
        "fused_recurrent_fp32_k64_v64_varlen_gany_gfp32_sfp32_ieee"]
    unit = cell80["units"][0]
    assert unit["ok"] and unit["kernels"] and unit["kernels"][0]["compile_s"] > 0
    assert data["versions"][0]["env"] == "installed (this interpreter)"


@pytest.mark.skipif(installed_triton() is None, reason="needs an installed Triton")
def test_reuse_compiles_only_the_units_whose_source_changed(tmp_path: Path) -> None:
    """--reuse: a second run over the same tree keeps every built unit of the first (nothing compiled, the same
    cells); where a recorded source hash no longer matches (a template change), that unit alone is compiled
    again, and a unit recorded as failed is always compiled again."""
    from dplr_gen.cli import app

    tv = str(installed_triton())
    spec = _spec(tmp_path, "sm_80, sm_90", name="tiny_reuse")
    first, second, third = (tmp_path / n for n in ("first", "second", "third"))

    def run(out: Path, *extra: str) -> dict:
        res = CliRunner().invoke(app, ["compat", "--triton", tv, "--specs", str(spec), "--out", str(out), "-j", "2",
                                       *extra])
        assert res.exit_code == 0, res.output
        return json.loads((out / "compat.json").read_text())

    a = run(first)
    units = [r for cell in a["cells"] for r in cell["units"]]
    assert len(units) == 4 and all(r["ok"] and len(r["source_hash"]) == 16 and not r.get("reused") for r in units)
    b = run(second, "--reuse", str(first / "compat.json"))
    again = [r for cell in b["cells"] for r in cell["units"]]
    assert all(r["reused"] for r in again) and b["versions"][0]["units_reused"] == 4
    assert [{k: v for k, v in r.items() if k != "reused"} for r in again] == units
    assert [c["status"] for c in b["cells"]] == [c["status"] for c in a["cells"]]
    md = (second / "compat.md").read_text()
    assert "| 4 (4 reused) |" in md and f"--reuse {first / 'compat.json'}" in md and "keep that result" in md
    # one unit's recorded source differs, another is recorded as failed: both compile again, the rest are kept
    stale = json.loads((first / "compat.json").read_text())
    recs = [r for cell in stale["cells"] for r in cell["units"]]
    recs[0]["source_hash"] = "0" * 16
    recs[1]["ok"] = False
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    c3 = run(third, "--reuse", str(tmp_path / "stale.json"))
    by_unit = {(cell["target"], r["unit"]): r for cell in c3["cells"] for r in cell["units"]}
    recompiled = {k for k, r in by_unit.items() if not r.get("reused")}
    assert recompiled == {(cell["target"], r["unit"]) for cell in stale["cells"] for r in cell["units"]
                          if r is recs[0] or r is recs[1]}
    assert all(r["ok"] for r in by_unit.values()) and c3["versions"][0]["units_reused"] == 2
    res = CliRunner().invoke(app, ["compat", "--reuse", str(tmp_path / "none.json"), "--triton", tv])
    assert res.exit_code == 2 and "--reuse" in res.output and "no such file" in res.output
    for text in ("{not json", '{"cells": 3}'):
        (tmp_path / "bad.json").write_text(text)
        res = CliRunner().invoke(app, ["compat", "--reuse", str(tmp_path / "bad.json"), "--triton", tv])
        assert res.exit_code == 2 and "--reuse" in res.output and "not a compat.json" in res.output, res.output


def test_pairwise_is_refused_with_full(tmp_path: Path) -> None:
    from dplr_gen.cli import app

    res = CliRunner().invoke(app, ["compat", "--full", "--pairwise", "--triton", "3.1.0", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--pairwise" in res.output and "--full" in res.output
    assert not list(tmp_path.iterdir())


def test_docs_compat_matches_the_tree() -> None:
    """docs/compat.md describes the templates, quirk registry and specs of this tree: a change to any of them
    fails here until the matrix is regenerated (the message names the command)."""
    data = json.loads((REPO_ROOT / "docs" / "compat.json").read_text())
    why = c.staleness(data)
    assert not why, ("docs/compat.md is stale: " + "; ".join(why) + ". Regenerate it with: "
                     + c.rerun_command(data))
    assert (REPO_ROOT / "docs" / "compat.md").read_text() == c.render_markdown(data)


def test_staleness_names_each_changed_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "a.py.jinja").write_text("one")
    quirks = tmp_path / "quirks.yaml"
    quirks.write_text("[]")
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "s.yaml").write_text("name: s")
    monkeypatch.setattr(c, "TEMPLATES_DIR", templates)
    monkeypatch.setattr(c, "QUIRKS_FILE", quirks)
    monkeypatch.setattr(c, "REPO_ROOT", tmp_path)
    data = {"source": c._inputs_state(), "complete": True,
            "specs": [{"file": "specs/s.yaml", "sha256_16": c.source_hash("name: s")}]}
    assert c.staleness(data, specs) == []
    (templates / "a.py.jinja").write_text("two")
    (templates / "b.py.jinja").write_text("new")
    quirks.write_text("[] # edited")
    (specs / "s.yaml").write_text("name: s # edited")
    (specs / "t.yaml").write_text("name: t")
    why = c.staleness({**data, "complete": False}, specs)
    assert any(w.startswith("template a.py.jinja changed") for w in why), why
    assert "template b.py.jinja is not in the matrix" in why
    assert any(w.startswith("quirks.yaml changed") for w in why), why
    assert any(w.startswith("spec specs/s.yaml changed") for w in why), why
    assert "spec specs/t.yaml is not in the matrix" in why
    assert "the run that wrote it did not finish" in why
    assert len(why) == 6


def test_compat_check_command(tmp_path: Path) -> None:
    from dplr_gen.cli import app

    # a matrix of this tree as it stands (what `dplr-gen compat` records)
    data = {"command": "dplr-gen compat --full --jobs 2  (default releases: 3.1.0)", "complete": True,
            "source": c._inputs_state(),
            "specs": [{"file": f"specs/{p.name}", "sha256_16": c.source_hash(p.read_text())}
                      for p in sorted((REPO_ROOT / "specs").glob("*.yaml"))]}
    out = tmp_path / "docs"
    out.mkdir()
    (out / "compat.json").write_text(json.dumps(data))
    res = CliRunner().invoke(app, ["compat", "--check", "--out", str(out)])
    assert res.exit_code == 0, res.output
    # current, but a cell failed to build: refused too (the template must compile wherever the specs promise)
    cells = [c._cell("hopper", "sm_90", "3.1.0"), c._cell("hopper", "sm_90", "3.2.0")]
    cells[0].update(status="built")
    cells[1].update(status="failed", error="chunk_fp16_k128 unit: MLIR pass manager failed")
    (out / "compat.json").write_text(json.dumps({**data, "cells": cells}))
    res = CliRunner().invoke(app, ["compat", "--check", "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert "FAILED hopper sm_90 Triton 3.2.0: chunk_fp16_k128 unit: MLIR pass manager failed" in res.output
    assert "1 of its cells failed to build" in res.output
    data["source"]["templates"]["chunk_dplr.py.jinja"] = "0" * 16
    (out / "compat.json").write_text(json.dumps(data))
    res = CliRunner().invoke(app, ["compat", "--check", "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert "template chunk_dplr.py.jinja changed" in res.output
    assert "regenerate it with: dplr-gen compat --full --jobs 2\n" in res.output


def test_pip_install_tries_again_without_its_cache_and_reports_every_attempt() -> None:
    """A download altered on the way fails one attempt, not the compatibility run; every attempt failing
    raises with each attempt's error."""
    import subprocess as sp

    seen: list[list[str]] = []

    def flaky(fails: int):
        def run(cmd, **kw):
            seen.append(cmd)
            ok = len(seen) > fails
            return sp.CompletedProcess(cmd, 0 if ok else 1, "", "" if ok else f"HASHES DO NOT MATCH ({len(seen)})")
        return run

    c._pip_install(Path("py"), ["triton==3.2.0"], "triton", run=flaky(2), pause=lambda s: None)
    assert len(seen) == 3
    assert "--no-cache-dir" not in seen[0] and all("--no-cache-dir" in cmd for cmd in seen[1:])
    assert all(cmd[-1] == "triton==3.2.0" for cmd in seen)

    seen.clear()
    with pytest.raises(RuntimeError, match=r"in 3 attempts.*\(1\).*\(2\).*\(3\)"):
        c._pip_install(Path("py"), ["triton==3.2.0"], "triton", run=flaky(5), pause=lambda s: None)
    assert len(seen) == 3

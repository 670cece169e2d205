"""scripts/ptxas_report.py: registers and spills of a built package's kernels, from the PTX the build kept."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dplr_gen.toolchain import build as b

REPO = Path(__file__).resolve().parent.parent
LOOP = "fused_recurrent_dplr_fwd_kernel"  # the kernel the spec below tunes (stage fused_recurrent.fwd)
SPEC = """
name: regs
targets: [sm_80, sm_90]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp16]
    head_dims: [64]
    varlen: [false]
tuning:
  fused_recurrent.fwd: {{num_warps: {warps}{extra}}}
"""


def _report_module():
    spec = importlib.util.spec_from_file_location("ptxas_report", REPO / "scripts" / "ptxas_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(tmp_path: Path, warps: int, max_registers: int | None = None, name: str | None = None) -> Path:
    name = name or f"regs{warps}"
    spec = tmp_path / f"{name}.yaml"
    extra = f", max_registers: {max_registers}" if max_registers else ""
    spec.write_text(SPEC.format(warps=warps, extra=extra).replace("name: regs", f"name: {name}"))
    report = b.build(spec, jobs=2, out_root=tmp_path / "gen")
    assert not report.failures, report.failures
    return tmp_path / "gen" / name


def test_report_reads_every_kernel_of_a_built_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    mod = _report_module()
    rows = {w: mod.report(_build(tmp_path, w)) for w in (1, 4)}
    for w, rs in rows.items():
        manifest = json.loads((tmp_path / "gen" / f"regs{w}" / "manifest.json").read_text())
        # two kernels (the loop over tokens, tuned here; the decode step, at its defaults), two archs
        assert len(rs) == sum(len(u["kernels"]) for u in manifest["units"].values()) == 4
        for r in rs:
            assert 16 <= r["registers"] <= 255 and r["spill_stores"] >= 0
            assert r["num_warps"] == (w if r["kernel"] == LOOP else 4), r
    # the same kernel over four times the threads holds fewer values per thread
    loops = {w: [r for r in rs if r["kernel"] == LOOP] for w, rs in rows.items()}
    for a, b4 in zip(loops[1], loops[4]):
        assert a["unit"].replace("regs1", "") == b4["unit"].replace("regs4", "")
        assert b4["registers"] < a["registers"], (a, b4)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "ptxas_report.py"), str(tmp_path / "gen" / "regs4"),
                           "--match", "sm_90", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["unit"].endswith("sm_90") for r in json.loads(out.read_text())["rows"]] == [True, True]


def test_unbuilt_package_is_named(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    with pytest.raises(SystemExit, match="no manifest.json"):
        _report_module().report(tmp_path / "p")


def test_register_cap_is_compiled_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's max_registers knob reaches the compiler: the ahead-of-time kernel uses at most that many
    registers a thread (ptxas on the PTX the build kept), where the uncapped one uses more."""
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    mod = _report_module()
    free = {r["unit"].rsplit("__", 1)[1]: r for r in mod.report(_build(tmp_path, 1, name="free")) if r["kernel"] == LOOP}
    capped = {r["unit"].rsplit("__", 1)[1]: r for r in mod.report(_build(tmp_path, 1, 64, name="capped"))
              if r["kernel"] == LOOP}
    assert set(free) == set(capped) == {"sm_80", "sm_90"}
    for arch in free:
        assert free[arch]["registers"] > 64 >= capped[arch]["registers"], (free[arch], capped[arch])

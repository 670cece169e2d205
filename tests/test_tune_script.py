"""benchmarks/tune.py's control flow on CPU (--dry-run: interpreter, fp32, tiny shapes, no AOT build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_tune_dry_run_measures_every_setting(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tune.py"), "--dry-run", "--dims", "16", "--chunks", "16",
         "--warps", "2,4", "--num-stages", "1", "--block-v", "16"],
        env=env, text=True, capture_output=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (res_file,) = tmp_path.glob("tune_*.json")
    res = json.loads(res_file.read_text())
    assert len(res["rows"]) == 2 and set(res["settings"]) == {"tune00", "tune01"}
    for row in res["rows"]:
        assert "error" not in row, row
        assert max(row["err"].values()) < 1e-5  # fp32 interpreter vs the float64 reference
        assert set(row["ms"]) == {"prep", "fwd", "states", "prep_bwd", "prep_bwd_kept", "prep_both",
                                   "fwd_kept", "fwd_train", "bwd_dh", "bwd"} and all(t > 0 for t in row["ms"].values())
    # each stage saw both warp counts: the settings are offset, not repeated
    warps = {st: {res["settings"][r]["fwd"]["num_warps"] for r in res["settings"]} for st in ("fwd",)}
    assert warps["fwd"] == {2, 4}
    assert "D=16 C=16 bwd" in "\n".join(res["table"])


@pytest.mark.parametrize("bwd", ["", "  chunk.bwd: {states_every: 32}\n"], ids=["as-is", "derives-states"])
def test_tune_package_mode_times_a_built_package_as_shipped(tmp_path: Path, bwd: str) -> None:
    """--package times every stage of the package's own kernels, including a token pass that derives every second
    state from the backward prep's operands (it takes them as an argument: the stage failed without them)."""
    from dplr_gen.toolchain import build as b

    spec = tmp_path / "shipped.yaml"
    spec.write_text("name: shipped\ntargets: [sm_90]\nvariants:\n  - ops: [chunk]\n    dtypes: [fp32]\n"
                    "    head_dims: [16]\n    chunk_sizes: [16]\n    varlen: [false]\n    gate_bounds: [-0.61]\n"
                    "tuning:\n  chunk.fwd: {num_warps: 2, num_stages: 1, block_v: 16}\n" + bwd)
    b.write_package(b.plan(spec, tmp_path / "gen"))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tune.py"), "--dry-run", "--dims", "16", "--chunks", "16",
         "--package", str(tmp_path / "gen" / "shipped")],
        env=env, text=True, capture_output=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (res_file,) = tmp_path.glob("tune_*.json")
    res = json.loads(res_file.read_text())
    assert res["settings"] == {} and [r["spec"] for r in res["rows"]] == ["shipped"]  # no sweep: one row
    (row,) = res["rows"]
    assert "error" not in row, row
    assert max(row["err"].values()) < 1e-5
    assert row["constexprs"]["chunk_dplr_fwd_kernel"]["BV"] == 16  # the package's own knobs
    assert res["table"] == ["D=16 C=16 " + " ".join(f"{st} {ms:.3f}" for st, ms in row["ms"].items())]


def test_tune_package_mode_names_a_folder_that_is_not_a_package(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tune.py"), "--dry-run", "--package", str(tmp_path / "nope")],
        env=dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(REPO)), text=True, capture_output=True, timeout=300,
    )
    assert proc.returncode == 2 and "--package" in proc.stderr and "no index.json" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("tune_*.json"))

"""The dplr-gen command: help everywhere, exit codes 0 / 1 / 2, list / show / doctor / clean."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dplr_gen.toolchain import build as b
from dplr_gen.cli import app

runner = CliRunner()

SPEC = """
name: cli_test
targets: [sm_80]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp16]
    head_dims: [32]
    varlen: [false]
"""


@pytest.mark.parametrize("cmd", [[], ["build"], ["list"], ["show"], ["doctor"], ["clean"]])
def test_help(cmd: list[str]) -> None:
    res = runner.invoke(app, [*cmd, "--help"])
    assert res.exit_code == 0 and "Usage" in res.output


def test_bad_spec_exits_2(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64], chunk_sizes: [7]}]\n")
    for cmd in (["build", str(p)], ["list", str(p)], ["build", "--check", str(p)]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2, res.output
        assert "chunk_sizes" in res.output


def test_missing_spec_and_bad_usage_exit_2(tmp_path: Path) -> None:
    assert runner.invoke(app, ["build", str(tmp_path / "nope.yaml")]).exit_code == 2
    assert runner.invoke(app, ["build", "--jobs", "0", "x.yaml"]).exit_code == 2
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2


def test_build_check_list_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(b, "GENERATED", tmp_path / "gen")
    spec = tmp_path / "cli_test.yaml"
    spec.write_text(SPEC)
    assert runner.invoke(app, ["build", "--check", str(spec)]).exit_code == 1  # nothing rendered yet
    res = runner.invoke(app, ["build", "-j", "1", str(spec)])
    assert res.exit_code == 0, res.output
    assert runner.invoke(app, ["build", "--check", str(spec)]).exit_code == 0
    res = runner.invoke(app, ["build", str(spec)])
    assert res.exit_code == 0 and "up to date" in res.output
    res = runner.invoke(app, ["list", str(spec)])
    assert res.exit_code == 0 and "built" in res.output and "sm_80" in res.output
    res = runner.invoke(app, ["clean", str(spec)])
    assert res.exit_code == 0 and "removed" in res.output
    assert not (tmp_path / "gen" / "cli_test" / "manifest.json").exists()


def test_show_and_doctor() -> None:
    res = runner.invoke(app, ["show", "no_such_variant"])
    assert res.exit_code == 2 and "no variant named" in res.output
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 0 and "triton" in res.output and "cache" in res.output and "launch stubs" in res.output

"""Spec errors say file:line:column: validation errors (field path -> the line of its key or value), YAML syntax
errors (the file, not "<unicode string>"), with "did you mean" for an unknown key; through the real command too."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dplr_gen.cli import app
from dplr_gen.spec.models import SpecError, load_spec

BAD_FIELDS = """\
name: typo
targets: [sm_80]
variants:
  - ops: [chunk]
    dtypes: [fp16]
    head_dim: [64]
  - dtypes: [bf16]
    head_dims: [64]
    chunk_sizes: [7]
tuning:
  chunk.fwd: {num_warps: 3, block_vv: 32}
"""


def _error(path: Path) -> str:
    with pytest.raises(SpecError) as e:
        load_spec(path)
    return str(e.value)


def test_validation_errors_name_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "typo.yaml"
    p.write_text(BAD_FIELDS)
    msg = _error(p)
    assert f"{p}:6:5: variants.0.head_dim: unknown key; did you mean 'head_dims'?" in msg, msg
    assert f"{p}:4:5: variants.0.head_dims: Field required" in msg, msg  # the mapping that lacks it
    assert f"{p}:9:19: variants.1.chunk_sizes.0: Input should be 16, 32 or 64 (got 7)" in msg, msg
    assert f"{p}:11:26: tuning.chunk.fwd.num_warps:" in msg, msg
    assert f"{p}:11:29: tuning.chunk.fwd.block_vv: unknown key; did you mean 'block_v'?" in msg, msg


@pytest.mark.parametrize("text, line, col, what", [
    ("name: x\ntargets: [sm_80\nvariants: []\n", 3, 9, "expected ',' or ']'"),
    ("name: x\ntargets: [sm_80]\nvariants:\n  - dtypes: [fp16]\n   head_dims: [64]\n", 5, 4, "expected <block end>"),
    ("name: x\n\ttargets: [sm_80]\n", 2, 1, "found character '\\t'"),
])
def test_yaml_syntax_errors_name_the_file_line_and_column(tmp_path: Path, text: str, line: int, col: int,
                                                         what: str) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text(text)
    msg = _error(p)
    assert msg.startswith(f"{p}:{line}:{col}: not valid YAML") and what in msg, msg
    assert "<unicode string>" not in msg


def test_cli_shows_file_line_column(tmp_path: Path) -> None:
    p = tmp_path / "typo.yaml"
    p.write_text(BAD_FIELDS)
    for cmd in ("build", "list"):
        res = CliRunner().invoke(app, [cmd, str(p)])
        assert res.exit_code == 2 and f"{p}:6:5: variants.0.head_dim: unknown key; did you mean 'head_dims'?" in res.output
    p.write_text("name: x\ntargets: [sm_80\n")
    res = CliRunner().invoke(app, ["build", str(p)])
    assert res.exit_code == 2 and f"{p}:3:1: not valid YAML" in res.output, res.output

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


REPO = Path(__file__).resolve().parent.parent


def test_name_differing_from_the_file_stem_is_refused_naming_both(tmp_path: Path) -> None:
    """A copy of specs/ada.yaml saved as rtx4090.yaml with `name: ada` left in would render into generated/ada/."""
    p = tmp_path / "rtx4090.yaml"
    p.write_text((REPO / "specs" / "ada.yaml").read_text())
    msg = _error(p)
    assert f"{p}:2:7: name: 'ada' differs from the file's stem 'rtx4090'" in msg, msg
    assert "generated/ada/" in msg and "`name: rtx4090`" in msg and "rename the file to ada.yaml" in msg, msg
    # the stem's package name is what `name` must be: dashes become underscores, and no name line takes it
    text = (REPO / "specs" / "ada.yaml").read_text().replace("name: ada\n", "")
    (tmp_path / "rtx-4090.yaml").write_text(text)
    assert load_spec(tmp_path / "rtx-4090.yaml").name == "rtx_4090"
    (tmp_path / "rtx-4090.yaml").write_text("name: rtx_4090\n" + text)
    assert load_spec(tmp_path / "rtx-4090.yaml").name == "rtx_4090"


def test_every_spec_in_the_tree_is_named_after_its_file() -> None:
    for path in sorted((REPO / "specs").glob("*.yaml")):
        assert load_spec(path).name == path.stem


TUNING_TYPOS = """\
name: stages
targets: [sm_80]
variants:
  - dtypes: [bf16]
    head_dims: [64]
tuning:
  chunk.fwd: {num_warps: 4}
  chunk.bwdd: {block_v: 16}
target_tuning:
  sm_80:
    chunk.prp: {num_stages: 1}
variant_tuning:
  - when: {K: [64]}
    tuning:
      chunk.fwd: {overlap: true}
"""


def test_misspelled_stages_name_their_line_and_the_nearest_stage(tmp_path: Path) -> None:
    p = tmp_path / "stages.yaml"
    p.write_text(TUNING_TYPOS)
    msg = _error(p)
    assert f"{p}:8:3: tuning.chunk.bwdd: unknown stage 'chunk.bwdd'; did you mean 'chunk.bwd'?" in msg, msg
    assert f"{p}:11:5: target_tuning.sm_80.chunk.prp: unknown stage 'chunk.prp'; did you mean 'chunk.prep'?" in msg
    assert f"{p}:15:19: variant_tuning.0.tuning.chunk.fwd.overlap: only chunk.bwd_dh take the overlap knob" in msg
    assert "(top level)" not in msg and ":1:1:" not in msg, msg


def test_a_value_no_union_member_takes_is_one_line(tmp_path: Path) -> None:
    """head_dims takes an int or a pair: pydantic's one error per member (constrained-int, tuple[...]) becomes one
    line with the field, file:line, what was found and what the field takes."""
    p = tmp_path / "dims.yaml"
    p.write_text("name: dims\ntargets: [sm_80]\nvariants:\n  - dtypes: [bf16]\n    head_dims: [64, big, [16, x]]\n")
    lines = _error(p).splitlines()
    assert lines[1:] == [
        f"  {p}:5:21: variants.0.head_dims.1: got 'big'; valid: head sizes: an int means K = V, a pair is [K, V]; "
        "16 to 256",
        f"  {p}:5:26: variants.0.head_dims.2: got [16, 'x']; valid: head sizes: an int means K = V, a pair is "
        "[K, V]; 16 to 256",
    ], lines

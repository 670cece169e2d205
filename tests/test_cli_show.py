"""`dplr-gen show`: the source for the spec and target asked for; a name in several specs lists them; unknown
names get the nearest distinct names. Through the command's entry point, over the checked-in generated/."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dplr_gen.cli import app

REPO = Path(__file__).resolve().parent.parent
GEN = REPO / "generated"
# a variant that ada (sm_89) and ampere (sm_80, sm_86) both have
NAME = "chunk_fp32_k64_v64_c16_dense_gany_gfp32_sfp32_ieee"


def show(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, ["show", *args], env={"COLUMNS": "300"})
    return res.exit_code, res.stdout, res.stderr


def source(spec: str, target: str) -> str:
    return (GEN / spec / NAME / f"{target}.py").read_text()


def test_spec_and_target_pick_the_source() -> None:
    assert source("ampere", "sm_80") != source("ada", "sm_89")
    for args, spec, target in (
        (["--spec", "specs/ampere.yaml", "--target", "sm_86"], "ampere", "sm_86"),
        (["--spec", "ampere"], "ampere", "sm_80"),
        (["--target", "sm_80"], "ampere", "sm_80"),
        (["--target", "86"], "ampere", "sm_86"),
        (["--spec", str(REPO / "specs" / "ada.yaml")], "ada", "sm_89"),
    ):
        code, out, err = show(NAME, *args)
        assert code == 0 and out == source(spec, target), (args, err)
        assert f"# {spec} " in err and target in err
    code, out, err = show(f"{NAME}__sm_86")
    assert code == 0 and out == source("ampere", "sm_86")
    assert "also rendered for sm_86" in show(NAME, "--spec", "ampere")[2]


def test_name_in_several_specs_lists_them() -> None:
    code, out, err = show(NAME)
    assert code == 2 and out == ""
    assert "ada (specs/ada.yaml: sm_89)" in err and "ampere (specs/ampere.yaml: sm_80, sm_86)" in err, err
    assert "--spec" in err


def test_target_not_rendered_names_those_that_are() -> None:
    code, _, err = show(NAME, "--spec", "ampere", "--target", "sm_89")
    assert code == 2 and "not rendered for sm_89" in err and "ampere: sm_80, sm_86" in err, err


def test_unknown_name_suggests_distinct_nearest_names() -> None:
    code, _, err = show("chunk_fp32_k64_v64_c16_dense_gany")
    assert code == 2 and "no variant named 'chunk_fp32_k64_v64_c16_dense_gany'" in err
    nearest = err.split("nearest: ")[1].split(" (")[0].split(", ")
    known = {v for p in GEN.glob("*/index.json") for v in json.loads(p.read_text())["variants"]}
    assert len(nearest) == len(set(nearest)) == 5 and set(nearest) <= known, nearest
    assert nearest[0] == NAME
    code, _, err = show("no_such_variant", "--spec", "no_such_spec")
    assert code == 2 and "not rendered" in err

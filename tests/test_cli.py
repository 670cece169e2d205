"""The dplr-gen command: help everywhere, exit codes 0 / 1 / 2, list / show / doctor / clean."""

from __future__ import annotations

import json

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


SHARED = SPEC.replace("name: cli_test", "name: {name}")


def _shared_specs(tmp_path: Path, *names: str) -> dict[str, Path]:
    """Specs of the same variants under other names: their kernels are the same cache entries."""
    paths = {}
    for name in names:
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(SHARED.format(name=name))
    return paths


@pytest.fixture
def private_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """generated/ and the kernel cache under the test's folder."""
    from dplr_gen.runtime import loader

    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(b, "GENERATED", tmp_path / "gen")
    monkeypatch.setattr(loader, "GENERATED", tmp_path / "gen")
    return tmp_path


def _kernel_entries(tmp_path: Path) -> set[Path]:
    return {m.parent for m in (tmp_path / "cache").glob("triton-*/*/*/meta.json")}


def test_clean_keeps_the_kernels_other_specs_use(private_tree: Path) -> None:
    """Two specs share their kernels; cleaning one leaves the other built: it lists as built, its variant loads
    prebuilt, and a build of either compiles nothing. Only cleaning the last user removes the kernels."""
    from dplr_gen.runtime.loader import SpecPackage

    specs = _shared_specs(private_tree, "share_a", "share_b")
    res = runner.invoke(app, ["build", "-j", "1", str(specs["share_a"])])
    assert res.exit_code == 0 and "2 kernels: 2 compiled, 0 found in the kernel cache" in res.output, res.output
    res = runner.invoke(app, ["build", "-j", "1", str(specs["share_b"])])
    assert res.exit_code == 0 and "2 kernels: 0 compiled, 2 found in the kernel cache" in res.output, res.output
    entries = _kernel_entries(private_tree)
    # direct-launch records a GPU machine would have kept: the shared kernel's, and another kernel's that names
    # one of the same C modules
    from dplr_gen.toolchain import launch_direct

    assert len(entries) == 2  # the unit's loop kernel and its decode step's
    entry = sorted(entries)[0]
    tv, key = entry.parents[1].name.removeprefix("triton-"), entry.name
    records = launch_direct.records_dir(private_tree / "cache", tv)
    (records / "modules").mkdir(parents=True)
    for module in ("stub1", "stub2", "utils"):
        (records / "modules" / f"{module}.so").write_bytes(b"")
    (records / f"{key}.json").write_text(json.dumps({"stub": "stub1", "utils": "utils"}))
    (records / "other.json").write_text(json.dumps({"stub": "stub2", "utils": "utils"}))

    res = runner.invoke(app, ["clean", str(specs["share_a"])])
    assert res.exit_code == 0, res.output
    assert "share_a: removed the manifest and 0 cached kernels" in res.output and "kept 2" in res.output, res.output
    assert (records / f"{key}.json").is_file()  # its kernel kept: so is its record
    assert _kernel_entries(private_tree) == entries
    res = runner.invoke(app, ["list", str(specs["share_b"])])
    assert "built" in res.output and "not built" not in res.output and "kernels gone" not in res.output, res.output
    pkg = SpecPackage(private_tree / "gen" / "share_b")
    assert pkg.prebuilt(pkg.variant_names[0], "sm_80") and pkg.build_state().startswith("built here")
    assert "up to date" in runner.invoke(app, ["build", str(specs["share_b"])]).output
    res = runner.invoke(app, ["build", "-j", "1", str(specs["share_a"])])  # rebuilt from the kept kernels
    assert "2 kernels: 0 compiled, 2 found in the kernel cache" in res.output, res.output

    for name in ("share_a", "share_b"):  # the last user cleaned: its kernels go
        res = runner.invoke(app, ["clean", str(specs[name])])
        assert res.exit_code == 0, res.output
    assert "removed the manifest and 2 cached kernels" in res.output and "kept" not in res.output, res.output
    assert not _kernel_entries(private_tree) & entries
    # the removed kernel's record went, and the C module only it named
    assert sorted(p.name for p in records.glob("*.json")) == ["other.json"]
    assert sorted(p.name for p in (records / "modules").iterdir()) == ["stub2.so", "utils.so"]


def test_clean_keeps_kernels_of_packages_built_elsewhere(private_tree: Path) -> None:
    """A package built outside generated/ (another checkout, a script's out_root) sharing the cache is known to
    it: cleaning the spec under generated/ keeps that package's kernels."""
    specs = _shared_specs(private_tree, "share_a", "share_c")
    b.build(specs["share_c"], jobs=1, out_root=private_tree / "elsewhere", stubs=False)
    assert runner.invoke(app, ["build", "-j", "1", str(specs["share_a"])]).exit_code == 0
    res = runner.invoke(app, ["clean", str(specs["share_a"])])
    assert "0 cached kernels" in res.output and "kept 2" in res.output, res.output
    assert b.manifest_is_current(b.plan(specs["share_c"], private_tree / "elsewhere"),
                                 b.read_manifest(private_tree / "elsewhere" / "share_c"), private_tree / "cache")


def test_status_says_built_only_while_the_kernels_are_there(private_tree: Path) -> None:
    """A manifest whose cache entries are gone (the cache removed by hand) is not "built": not in `list`, not in
    `doctor`, not to the loader."""
    import shutil

    from dplr_gen.runtime.loader import SpecPackage

    (spec,) = _shared_specs(private_tree, "share_a").values()
    assert runner.invoke(app, ["build", "-j", "1", str(spec)]).exit_code == 0
    shutil.rmtree(private_tree / "cache")
    res = runner.invoke(app, ["list", str(spec)], env={"COLUMNS": "200"})
    assert "kernels gone" in res.output and "`dplr-gen build" in res.output, res.output
    pkg = SpecPackage(private_tree / "gen" / "share_a")
    variant = pkg.variant_names[0]
    assert not pkg.prebuilt(variant, "sm_80")
    unit = pkg.index["variants"][variant]["targets"]["sm_80"]["unit"]
    assert "gone from the cache" in pkg._not_built(pkg.manifest(), unit)
    res = runner.invoke(app, ["doctor"], env={"COLUMNS": "300"})
    assert "share_a (built here for Triton" in res.output and "units are gone from the cache" in res.output, res.output


def test_clean_without_a_spec_needs_all(private_tree: Path) -> None:
    (spec,) = _shared_specs(private_tree, "share_a").values()
    assert runner.invoke(app, ["build", "-j", "1", str(spec)]).exit_code == 0
    res = runner.invoke(app, ["clean"])
    assert res.exit_code == 2 and "--all" in res.output and "2 entries" in res.output, res.output
    assert _kernel_entries(private_tree)  # nothing removed
    res = runner.invoke(app, ["clean", "--all"])
    assert res.exit_code == 0, res.output
    assert "removed the kernel cache" in res.output and "2 entries" in res.output and "Triton 3." in res.output
    assert not (private_tree / "cache").exists() and not (private_tree / "gen" / "share_a" / "manifest.json").exists()


def test_messages_print_user_and_library_text_literally(tmp_path: Path) -> None:
    """Rich markup would eat bracketed text: the name pattern's [a-z] classes, a path with [x] or [red] in it."""
    folder = tmp_path / "specs [x] [red]"
    folder.mkdir()
    p = folder / "bad.yaml"
    p.write_text("name: Bad\ntargets: [sm_80]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n")
    for cmd in ("build", "list", "clean"):
        res = runner.invoke(app, [cmd, str(p)])
        assert res.exit_code == 2, res.output
        assert "String should match pattern '^[a-z][a-z0-9_]*$'" in res.output, res.output
        assert f"{p}:1:7: name:" in res.output, res.output
    res = runner.invoke(app, ["list", str(folder / "missing.yaml")])
    assert res.exit_code == 2 and f"{folder / 'missing.yaml'}: no such spec file" in res.output, res.output


@pytest.mark.parametrize("columns", [80, 200])
def test_list_keeps_variant_names_whole(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 80 columns (a pipe's default width too) the names of specs/hopper.yaml do not fit a table: each is printed
    whole on a line of its own, ready to paste into `dplr-gen show`; wide terminals keep the table."""
    from rich.console import Console

    from dplr_gen import cli

    spec = Path(__file__).resolve().parent.parent / "specs" / "hopper.yaml"
    # the console takes its width when made (rich reads COLUMNS then): one made for this width
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(cli, "out", Console())
    res = runner.invoke(app, ["list", str(spec)], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    words = [set(line.replace("│", " ").split()) for line in res.output.splitlines()]
    names = {u.variant.name for u in b.plan(spec).units}
    assert len(names) > 40
    missing = [n for n in names if not any(n in w for w in words)]
    assert not missing, (missing, res.output[:2000])
    assert ("┃ variant" in res.output) == (columns == 200)
    assert all(len(line) <= columns for line in res.output.splitlines() if "status:" not in line)

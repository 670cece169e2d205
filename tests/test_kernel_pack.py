"""A built spec's kernels packed into one archive and unpacked into another machine's (another folder's) cache:
the build there compiles nothing and the runtime loads the kernels; archives of another Triton release, foreign
members and missing builds are refused with the reason."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from dplr_gen.toolchain import build as b
from dplr_gen.toolchain import cache, kernel_pack
from dplr_gen.toolchain.package_kernels import aot_kernels, read_manifest, unit_module
from dplr_gen.toolchain.triton_versions import triton_version

from .test_build import SMALL  # the small spec the build tests compile


@pytest.fixture()
def packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, dict]:
    """(spec, archive, pack record) of the small spec built into tmp_path/gen with cache tmp_path/cache."""
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "small.yaml"
    spec.write_text(SMALL)
    report = b.build(spec, jobs=2, out_root=tmp_path / "gen")
    assert not report.failures
    archive = tmp_path / "small.tar.gz"
    record = kernel_pack.pack(tmp_path / "gen" / "small", archive)
    return spec, archive, record


def test_pack_holds_launch_files_only(packed: tuple[Path, Path, dict]) -> None:
    _, archive, record = packed
    assert record["kernels"] == 8 and record["targets"] == ["sm_80", "sm_90"]
    assert record["triton_version"] == str(triton_version())
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert kernel_pack.PACK_META in names
    suffixes = {n.rsplit("/", 1)[-1].rsplit(".", 1)[-1] for n in names if n != kernel_pack.PACK_META}
    assert suffixes == {"json", "cubin"}  # meta.json, the kernel's metadata and its binary; no ttgir, ptx, ...
    assert sum(n.endswith("/meta.json") for n in names) == 8  # 4 units x 2 kernels


def test_unpack_then_build_compiles_nothing_and_loads(packed: tuple[Path, Path, dict], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    spec, archive, _ = packed
    other = tmp_path / "other-cache"
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(other))
    got = kernel_pack.unpack(archive, str(triton_version()))
    assert (got.spec, got.added, got.kept) == ("small", 8, 0)
    again = kernel_pack.unpack(archive, str(triton_version()))
    assert (again.added, again.kept) == (0, 8)  # entries already there are kept
    report = b.build(spec, jobs=2, out_root=tmp_path / "gen2")
    assert not report.failures and report.kernels == 8
    compiled = [(o.unit, o.compiled) for o in report.outcomes if o.compiled]
    assert len(report.outcomes) == 4 and not compiled, compiled
    # the runtime's loader finds every kernel in the unpacked cache
    directory = tmp_path / "gen2" / "small"
    manifest = read_manifest(directory)
    assert manifest is not None and Path(manifest["cache_root"]) == other
    index = json.loads((directory / "index.json").read_text())
    for entry in index["variants"].values():
        for t in entry["targets"].values():
            kernels, why = aot_kernels(unit_module(directory, index["spec"], t), t["unit"], manifest)
            assert kernels, why


def test_unpack_refuses_another_release(packed: tuple[Path, Path, dict]) -> None:
    _, archive, _ = packed
    with pytest.raises(ValueError, match=r"compiled by Triton .* this machine has Triton 0\.0\.0"):
        kernel_pack.unpack(archive, "0.0.0")


def test_unpack_refuses_foreign_members(tmp_path: Path) -> None:
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in ((kernel_pack.PACK_META, json.dumps({"spec": "x", "triton_version": "9.9"}).encode()),
                           ("../outside.txt", b"no")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="unexpected member '../outside.txt'"):
        kernel_pack.unpack(archive, "9.9", tmp_path / "cache")
    assert not (tmp_path / "outside.txt").exists() and not (tmp_path / "cache").exists()
    plain = tmp_path / "plain.tar.gz"
    with tarfile.open(plain, "w:gz"):
        pass
    with pytest.raises(ValueError, match="no pack.json"):
        kernel_pack.unpack(plain, "9.9", tmp_path / "cache")


def test_pack_needs_a_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        kernel_pack.pack(tmp_path / "gen" / "small", tmp_path / "x.tar.gz")


def test_pack_names_kernels_gone_from_the_cache(packed: tuple[Path, Path, dict], tmp_path: Path) -> None:
    manifest = read_manifest(tmp_path / "gen" / "small")
    assert manifest is not None
    key = next(iter(manifest["units"].values()))["kernels"][0]["key"]
    (cache.entry_dir(key, manifest["triton_version"]) / cache.META).unlink()
    with pytest.raises(FileNotFoundError, match="1 of the 8 kernels"):
        kernel_pack.pack(tmp_path / "gen" / "small", tmp_path / "again.tar.gz")
    assert not (tmp_path / "again.tar.gz").exists()


def test_cli_says_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from dplr_gen.cli import app

    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "nowhere_built.yaml"
    spec.write_text(SMALL.replace("name: small", "name: nowhere_built"))
    res = CliRunner().invoke(app, ["pack", str(spec)])
    assert res.exit_code == 2 and "not built here" in res.output and "dplr-gen build" in res.output
    res = CliRunner().invoke(app, ["unpack", str(tmp_path / "missing.tar.gz")])
    assert res.exit_code == 2 and "no such file" in res.output

"""DPLR_GEN_* settings: a value a setting does not take is an error naming the variable and what it takes, where
the setting is read; an unknown DPLR_GEN_* name is warned about with the nearest name; DPLR_GEN_SPEC's error and
`dplr-gen doctor` describe the specs under generated/ in the same words."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from typer.testing import CliRunner

from rich.console import Console

from dplr_gen import cli
from dplr_gen.cli import app
from dplr_gen.runtime import dispatch, gate_check, loader, ondemand
from dplr_gen.runtime.loader import NotBuiltError
from dplr_gen.toolchain import cache, settings
from dplr_gen.toolchain.settings import SettingError

runner = CliRunner()
BROKEN_GATES = torch.full((4,), -2.0)  # below the promised lower_bound=-1


def _check_bound() -> Any:
    return gate_check.check_lower_bound(BROKEN_GATES, -1.0)


READERS: dict[str, Callable[[], Any]] = {
    "DPLR_GEN_CHECK_LOWER_BOUND": _check_bound,
    "DPLR_GEN_NO_JIT": lambda: loader.env_flag(loader.NO_JIT_ENV, False),
    "DPLR_GEN_KEEP_STUBS": loader.keeps_stubs,
    "DPLR_GEN_JIT_JOBS": lambda: ondemand.compile_processes(None),
    "DPLR_GEN_CACHE_DIR": cache.cache_root,
}


@pytest.mark.parametrize("name, value, takes", [
    ("DPLR_GEN_CHECK_LOWER_BOUND", "bogus", "sync (checked on the host"),
    ("DPLR_GEN_CHECK_LOWER_BOUND", "off", "0 or empty (not checked)"),
    ("DPLR_GEN_NO_JIT", "yes", "1 (never compile at run time"),
    ("DPLR_GEN_KEEP_STUBS", "2", "0 or empty (Triton's cache only, every launch through Triton)"),
    ("DPLR_GEN_JIT_JOBS", "many", "a whole number of compile processes"),
    ("DPLR_GEN_JIT_JOBS", "-2", "1 or more"),
    ("DPLR_GEN_CACHE_DIR", "FILE", "a directory for the kernel cache"),
])
def test_a_value_a_setting_does_not_take_is_an_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, takes: str) -> None:
    if value == "FILE":
        value = str(tmp_path / "a-file")
        Path(value).write_text("")
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError) as e:
        READERS[name]()
    assert str(e.value).startswith(f"{name}={value!r} is not valid") and takes in str(e.value), str(e.value)


def test_the_values_settings_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("DPLR_GEN_NO_JIT", value)
        assert loader.env_flag(loader.NO_JIT_ENV, False) is on
    monkeypatch.setenv("DPLR_GEN_KEEP_STUBS", "")
    assert not loader.keeps_stubs()
    monkeypatch.setenv("TRITON_INTERPRET", "true")  # Triton's own variable keeps Triton's reading: on
    assert loader.interpreting()
    for value, jobs in (("3", 3), ("0", ondemand.cpus()), ("", ondemand.cpus())):
        monkeypatch.setenv("DPLR_GEN_JIT_JOBS", value)
        assert ondemand.compile_processes(None) == jobs
    for value in ("", "0"):  # not checked
        monkeypatch.setenv("DPLR_GEN_CHECK_LOWER_BOUND", value)
        assert _check_bound() is None
    monkeypatch.setenv("DPLR_GEN_CHECK_LOWER_BOUND", "sync")
    with pytest.raises(ValueError, match="lower_bound=-1.0 promises"):
        _check_bound()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", "kernels")  # recorded in manifests: made absolute
    assert cache.cache_root() == tmp_path / "kernels"


def test_an_unknown_setting_name_is_warned_about_with_the_nearest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_NOJIT", "1")
    (line,) = settings.unknown()
    assert line.startswith("DPLR_GEN_NOJIT is not a dplr-gen setting") and "did you mean DPLR_GEN_NO_JIT?" in line
    res = runner.invoke(app, ["doctor"], env={"COLUMNS": "1000"})
    assert res.exit_code == 0
    warned = [ln for ln in res.output.splitlines() if ln.startswith("warning: DPLR_GEN_NOJIT")]
    assert len(warned) == 1 and "SettingWarning" not in res.output, res.output  # said once, by the command


def test_the_command_reports_a_bad_setting_as_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "a-file"))
    spec = Path(__file__).resolve().parent.parent / "specs" / "ampere.yaml"
    for cmd in (["build", str(spec)], ["clean", "--all"]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2 and "error: DPLR_GEN_CACHE_DIR=" in res.output and "it is a file" in res.output, \
            res.output
    res = runner.invoke(app, ["doctor"], env={"COLUMNS": "1000"})  # doctor reports, it does not fail
    assert res.exit_code == 0 and "DPLR_GEN_CACHE_DIR=" in res.output and "it is a file" in res.output


def test_spec_setting_and_doctor_describe_the_specs_in_the_same_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """DPLR_GEN_SPEC naming no spec under generated/ lists them as `doctor` does: each with whether it is built
    here (never "built" for a package without a manifest)."""
    pkgs = loader.all_packages(check_setting=False)
    assert pkgs
    monkeypatch.setenv("DPLR_GEN_SPEC", "nosuch")
    with pytest.raises(NotBuiltError) as e:
        dispatch.default_package().package_for(torch.device("cpu"))
    msg = str(e.value)
    assert msg.startswith("DPLR_GEN_SPEC='nosuch' names no spec under ") and "unset it" in msg, msg
    monkeypatch.delenv("DPLR_GEN_SPEC")
    # the console takes its width when made (rich reads COLUMNS then): one wide enough for every state
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setattr(cli, "out", Console())
    doctor = runner.invoke(app, ["doctor"], env={"COLUMNS": "1000"}).output
    for p in pkgs:
        state = f"{p.name} ({p.build_state()})"
        assert state in msg and state in doctor, (state, msg, doctor)
        if p.manifest() is None:
            assert p.build_state() == "not built here: no manifest.json"
    assert "built specs" not in msg and "specs under generated/" in doctor

"""`dplr-gen build` as a user meets it: Ctrl-C and a build waiting on another's lock through the real command in
processes of their own; what the summary counts, --force and the usage lines through the command's entry point."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dplr_gen.toolchain import build as b
from dplr_gen.cli import app

REPO = Path(__file__).resolve().parent.parent

SPEC = """
name: interrupt_test
targets: [sm_80]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp16, fp32, bf16]
    head_dims: [32, 64]
    varlen: [false]
"""

# the real command's entry point, with the package written under the test's folder instead of generated/. A job
# started in the background by a non-interactive shell (`&`, nohup, some CI runners) inherits SIGINT ignored, and
# Python keeps an inherited SIG_IGN: the child restores Ctrl-C's usual meaning, which the interrupt test relies on.
ENTRY = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
import sys
from pathlib import Path
from dplr_gen.toolchain import build
build.GENERATED = Path(sys.argv.pop(1))
from dplr_gen.cli import main
sys.argv[0] = "dplr-gen"
main()
"""


HOLD_LOCK = """
import sys, time
from pathlib import Path
from dplr_gen.toolchain.build import package_lock
with package_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, DPLR_GEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), COLUMNS="200")
    env.pop("TRITON_INTERPRET", None)
    return env


def start_build(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", ENTRY, str(tmp_path / "gen"), "build", *args, str(tmp_path / "interrupt_test.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path), start_new_session=True,
    )


def finished_kernels(tmp_path: Path) -> dict[Path, float]:
    # complete entries only: an entry being written sits in a .tmp-* folder until it is renamed into place
    return {m: m.stat().st_mtime for m in (tmp_path / "cache").glob("triton-*/*/[!.]*/meta.json")}


def compiles_running(pgid: int) -> int:
    """Processes of the build's group besides the build itself: its compile subprocesses."""
    n = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != pgid:
            try:
                n += os.getpgid(int(d.name)) == pgid
            except ProcessLookupError:
                pass
    return n


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.slow
def test_ctrl_c_stops_the_build_and_a_rerun_resumes(tmp_path: Path) -> None:
    (tmp_path / "interrupt_test.yaml").write_text(SPEC)
    proc = start_build(tmp_path, "-j", "1")
    deadline = time.monotonic() + 300
    # the first unit is compiled and the next one's compile is under way
    while not (finished_kernels(tmp_path) and compiles_running(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    before = finished_kernels(tmp_path)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)  # to the build only: its compile processes must be ended by it
    out, err = proc.communicate(timeout=60)
    stopped_in = time.monotonic() - t0
    assert proc.returncode == 130, (out, err)
    assert stopped_in < 10, stopped_in
    assert "interrupted" in err and "of 6 units were compiled" in err and "Rerun `dplr-gen build" in err, err
    assert "0/?" not in err
    time.sleep(0.5)
    assert not group_alive(proc.pid), "a compile process outlived the interrupted build"
    assert not (tmp_path / "gen" / "interrupt_test" / "manifest.json").exists()

    rerun = start_build(tmp_path, "-j", "2")
    out, err = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, (out, err)
    assert (tmp_path / "gen" / "interrupt_test" / "manifest.json").exists()
    after = finished_kernels(tmp_path)
    assert all(after[m] == t for m, t in before.items()), "a kernel finished before the interrupt was compiled again"


def test_build_waiting_on_a_lock_says_so(tmp_path: Path) -> None:
    """A build whose package lock another process holds names the lock and that process, then goes on once it
    is released."""
    (tmp_path / "interrupt_test.yaml").write_text(SPEC.replace("[fp16, fp32, bf16]", "[fp16]").replace("[32, 64]", "[32]"))
    out_dir = tmp_path / "gen" / "interrupt_test"
    out_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        proc = start_build(tmp_path, "-j", "1")
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "waiting for another build" in line and str(out_dir / ".lock") in line, line
        assert f"held by process {holder.pid}" in line, line
        time.sleep(1.0)
        assert proc.poll() is None  # still waiting
    finally:
        holder.communicate(timeout=30)  # closing its stdin releases the lock
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, (out, err)
    assert "0/?" not in err and "1 of 1 units built" in out, (out, err)


def test_summary_counts_units_like_list_and_force_recompiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(b, "GENERATED", tmp_path / "gen")
    spec = tmp_path / "interrupt_test.yaml"
    spec.write_text(SPEC.replace("[fp16, fp32, bf16]", "[fp16, fp32]").replace("[32, 64]", "[32]"))
    runner = CliRunner()
    res = runner.invoke(app, ["build", "-j", "2", str(spec)])
    assert res.exit_code == 0, res.output
    assert "2 of 2 units built (4 kernels: 4 compiled, 0 found in the kernel cache); 0 failed" in res.output, res.output
    assert "interrupt_test: 2 units" in runner.invoke(app, ["list", str(spec)]).output
    res = runner.invoke(app, ["build", str(spec)])
    assert "up to date, nothing to do (2 units built)" in res.output, res.output
    before = finished_kernels(tmp_path)
    time.sleep(0.05)
    res = runner.invoke(app, ["build", "--force", "-j", "2", str(spec)])
    assert res.exit_code == 0 and "4 kernels compiled (cache bypassed: --force)" in res.output, res.output
    after = finished_kernels(tmp_path)
    assert set(after) == set(before) and all(after[m] > t for m, t in before.items()), "--force reused the cache"


@pytest.mark.parametrize("cmd", [[], ["build"], ["list"], ["show"], ["doctor"], ["clean"], ["compat"]])
def test_usage_lines_show_metavars(cmd: list[str]) -> None:
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert "<bool>" not in res.output and "{" not in res.output.split("Usage:")[1].splitlines()[0], res.output
    usage = {"build": "build [OPTIONS] SPEC", "list": "list [OPTIONS] SPEC", "clean": "clean [OPTIONS] [SPEC]",
             "compat": "compat [OPTIONS] [SPEC]..."}
    if cmd and cmd[0] in usage:
        assert usage[cmd[0]] in res.output, res.output


def test_failing_build_prints_no_empty_bar(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntargets: [sm_80]\nvariants: [{dtypes: [fp16], head_dims: [32], chunk_sizes: [7]}]\n")
    res = CliRunner().invoke(app, ["build", str(bad)])
    assert res.exit_code == 2 and "0/?" not in res.output and "compiling" not in res.output, res.output


def test_build_off_a_terminal_prints_plain_progress_lines(tmp_path: Path) -> None:
    """stderr a pipe (CI logs, `| tee`, nohup): no bar redrawn in place, but plain lines with the units done of
    the total, the failures and the time, from the first unit to the last."""
    (tmp_path / "interrupt_test.yaml").write_text(SPEC.replace("[fp16, fp32, bf16]", "[fp16, fp32]")
                                                  .replace("[32, 64]", "[32]"))
    proc = start_build(tmp_path, "-j", "1")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, (out, err)
    assert "\r" not in err and "\x1b[" not in err and "━" not in err, err  # no bar, no cursor movement
    lines = [ln for ln in err.splitlines() if ln.startswith("compiling ")]
    spec = tmp_path / "interrupt_test.yaml"
    assert lines[0] == f"compiling {spec}: 2 units", err
    assert re.fullmatch(rf"compiling {re.escape(str(spec))}: 1/2 units done, 0 failed, \d+s elapsed \(last: "
                        r"fused_recurrent_fp\d+_k32_v32_dense_gany_gfp32_sfp32\w*__sm_80\)", lines[1]), lines
    assert lines[-1].startswith(f"compiling {spec}: 2/2 units done, 0 failed, "), lines

"""The ``dplr-gen`` command. Exit codes: 0 ok, 1 build failure (or stale with --check), 2 bad spec or usage,
130 interrupted (Ctrl-C)."""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand, TyperGroup
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .spec.models import SpecError
from .toolchain import settings


class _FlagsWithoutType:
    """Flags (on/off options, --help included) shown without a "<bool>" type column."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Group(_FlagsWithoutType, TyperGroup):
    pass


class _Command(_FlagsWithoutType, TyperCommand):
    """Usage lines with the arguments' metavars (``[OPTIONS] SPEC``), not Typer's ``{spec}``."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        params = self.get_params(ctx)
        pieces = ["[OPTIONS]"] if any(p.param_type_name == "option" for p in params) else []
        for p in params:
            if p.param_type_name == "argument" and (p.metavar or not p.hidden):
                name = p.metavar or (p.name or "").upper() + ("..." if p.nargs != 1 else "")
                pieces.append(name if p.required or name.startswith("[") else f"[{name}]")
        return pieces


app = typer.Typer(
    help="Generate, build and inspect DPLR delta-rule (RWKV-7) Triton kernels ahead of time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_Group,
)
out = Console()
err = Console(stderr=True)

EXIT_BUILD_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT


def _say(console: Console, *parts: str | tuple[str, str]) -> None:
    """Print one message literally: plain strings as they are, ``(text, style)`` pairs styled. Messages carry user
    and library text (paths, spec errors such as ``'^[a-z][a-z0-9_]*$'``) that Rich's markup would eat, so no
    markup is parsed and nothing is highlighted; lines are not wrapped, so names and paths can be pasted."""
    console.print(Text.assemble(*parts), soft_wrap=True, highlight=False)


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    _say(err, ("error:", "bold red"), " ", message)
    return typer.Exit(code)


def _command(name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command that first warns about DPLR_GEN_* variables dplr-gen does not read (a misspelt setting is
    otherwise ignored silently) and reports a setting's bad value as a usage error, not a traceback."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # Typer reads the parameters and the help through __wrapped__
        def run(*args: Any, **kwargs: Any) -> Any:
            for line in settings.unknown():
                _say(err, ("warning:", "yellow"), f" {line}")
            with warnings.catch_warnings():  # said above: the run time's own warning would repeat it
                warnings.simplefilter("ignore", settings.SettingWarning)
                settings.warn_unknown()
            try:
                return fn(*args, **kwargs)
            except settings.SettingError as e:
                raise _fail(str(e)) from None

        return app.command(name, cls=_Command)(run)

    return register


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class _BuildProgress:
    """The build's progress, shown once the compiles start (not while rendering, waiting for a lock, or failing).
    On a terminal a bar. Elsewhere (CI logs, `| tee`, nohup) a bar is one line redrawn in place, which a log
    keeps as nothing or a fragment: plain lines instead, after the first unit, every LINE_EVERY_S seconds, on a
    failure and at the end, each with the counts and the time."""

    LINE_EVERY_S = 5.0

    def __init__(self, spec: Path) -> None:
        self.spec = spec
        self.progress: Progress | None = None
        self.task: Any = None
        self.plain = not _is_terminal(sys.stderr)
        self.t0 = self.last_line = 0.0
        self.failed = 0

    def step(self, unit: str, done: int, total: int, failed: int) -> None:
        if self.plain:
            self._line(unit, done, total, failed)
            return
        if self.progress is None:
            self.progress = Progress(
                TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
                TextColumn("units"), TimeElapsedColumn(), TextColumn("{task.fields[unit]}", markup=False), console=err,
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task(f"compiling {self.spec}", total=total, unit="")
        self.progress.update(self.task, completed=done, total=total, unit=unit)

    def _line(self, unit: str, done: int, total: int, failed: int) -> None:
        now = time.monotonic()
        if done == 0:
            self.t0 = self.last_line = now
            _say(err, f"compiling {self.spec}: {total} units")
            return
        if done == 1 or done == total or failed > self.failed or now - self.last_line >= self.LINE_EVERY_S:
            _say(err, f"compiling {self.spec}: {done}/{total} units done, {failed} failed, "
                      f"{_duration(now - self.t0)} elapsed (last: {unit})")
            self.last_line, self.failed = now, failed

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


@_command()
def build(
    spec: Path = typer.Argument(..., metavar="SPEC", help="spec file, e.g. specs/ampere.yaml"),
    jobs: int = typer.Option(os.cpu_count() or 2, "--jobs", "-j", min=1, metavar="N",
                             help="compiles run in parallel"),
    check: bool = typer.Option(False, "--check", help="only check that generated/ matches the spec; exit 1 if stale"),
    force: bool = typer.Option(False, "--force", help="compile every kernel again, bypassing the kernel cache "
                               "(without it, kernels already in the cache are reused)"),
) -> None:
    """Render every variant, compile it for every target, verify, cache; write generated/<spec>/.
    Ctrl-C stops it within seconds; a rerun resumes (compiled kernels stay in the cache)."""
    from .toolchain import build as b

    try:
        if check:
            plan = b.plan(spec)
            stale = b.stale_files(plan)
            if stale:
                _say(err, ("stale:", "red"), f" {len(stale)} file(s) under {plan.out_dir} differ from {spec}:")
                for rel in stale[:20]:
                    _say(err, f"  {rel}")
                _say(err, f"run `dplr-gen build {spec}` and commit generated/")
                raise typer.Exit(EXIT_BUILD_FAILED)
            _say(out, f"{plan.out_dir} is up to date with {spec} ({len(plan.units)} units)")
            return
        bar = _BuildProgress(spec)
        try:
            report = b.build(spec, jobs=jobs, force=force, on_progress=bar.step,
                             on_wait=lambda message: _say(err, message))
        finally:
            bar.stop()
    except SpecError as e:
        raise _fail(str(e)) from None
    except b.BuildInterrupted as e:
        _say(err, f"interrupted: {len(e.done)} of {e.total} units were compiled, their kernels kept in the cache "
             f"({e.cache_root}); the running compiles were stopped. Rerun `dplr-gen build {spec}` to resume: "
             "finished kernels are not compiled again.")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except KeyboardInterrupt:
        _say(err, f"interrupted before any compile; rerun `dplr-gen build {spec}` to build.")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    for f in report.failures:
        _say(err, ("FAILED", "bold red"), f" {f.unit} ({f.target}): {f.error}")
    _say(out, f"{report.spec}: {_summary(report)}; {len(report.refused)} refused or filtered "
         f"(`dplr-gen list {spec}` says why); {report.seconds:.1f} s -> {report.out_dir}")
    if report.stubs:
        _say(out, f"{report.spec}: {report.stubs}")
    if report.failures:
        raise typer.Exit(EXIT_BUILD_FAILED)


def _summary(report: Any) -> str:
    """What the build did, in the units `dplr-gen list` counts (a unit: one variant for one target) and the
    kernels they hold (several per chunk unit: one per pass)."""
    if report.up_to_date:
        return f"up to date, nothing to do ({report.units} units built)"
    ok = report.units - len(report.failures)
    compiled = sum(len(o.compiled) for o in report.outcomes)
    how = (f"{report.kernels} kernels compiled (cache bypassed: --force)" if report.recompiled else
           f"{report.kernels} kernels: {compiled} compiled, {report.kernels - compiled} found in the kernel cache")
    return f"{ok} of {report.units} units built ({how}); {len(report.failures)} failed"


def _unit_states(plan: Any, manifest: dict[str, Any] | None) -> dict[str, Text]:
    """Each unit's status in `dplr-gen list`: "built" only where the manifest is this Triton's and every cache
    entry it names is there (a clean of another spec, or a cache removed by hand, leaves manifests behind)."""
    from .toolchain import build as b, clean

    manifest = manifest or {"units": {}, "failures": []}
    failed = {f["unit"] for f in manifest.get("failures", [])}
    other_triton = manifest.get("triton_version", str(plan.triton_version)) != str(plan.triton_version)
    gone = set() if other_triton else clean.units_without_kernels(manifest)
    stale = set(b.stale_files(plan))
    states = {}
    for u in plan.units:
        if plan.unit_files[u.name] in stale:
            states[u.name] = Text("not rendered", style="yellow")
        elif u.name in failed:
            states[u.name] = Text("failed", style="red")
        elif u.name not in manifest["units"]:
            states[u.name] = Text("not built")
        elif other_triton:
            states[u.name] = Text(f"built for Triton {manifest['triton_version']}", style="yellow")
        elif u.name in gone:
            states[u.name] = Text("kernels gone", style="yellow")
        else:
            states[u.name] = Text("built", style="green")
    return states


LIST_COLUMNS = ("variant", "target", "status", "shared mem", "warps", "quirks avoided")


@_command("list")
def list_(spec: Path = typer.Argument(..., metavar="SPEC", help="spec file")) -> None:
    """Variants, targets, build status and shared memory used."""
    from .toolchain import build as b

    try:
        plan = b.plan(spec)
    except SpecError as e:
        raise _fail(str(e)) from None
    manifest = b.read_manifest(plan.out_dir)
    states = _unit_states(plan, manifest)
    rows = []
    for u in plan.units:
        rec = (manifest or {}).get("units", {}).get(u.name)
        shared = f"{max(k['shared'] for k in rec['kernels'])} / {u.arch.smem_per_block}" if rec else "-"
        warps = ",".join(str(k["num_warps"]) for k in rec["kernels"]) if rec else "-"
        rows.append([Text(u.variant.name), Text(u.target), states[u.name], Text(shared), Text(warps),
                     Text(",".join(u.quirks) or "-")])
    title = f"{plan.spec.name}: {len(plan.units)} units, Triton {plan.triton_version}"
    table = Table(title=Text(title))
    # names spell every parameter and are pasted into `dplr-gen show`: never cut or wrapped; other columns fold
    table.add_column(LIST_COLUMNS[0], no_wrap=True)
    widths = [max(len(r[0]) for r in rows)] if rows else [len(LIST_COLUMNS[0])]
    for col in LIST_COLUMNS[1:]:  # no narrower than their headers (or a status), else a table is not worth it
        widths.append(max(len(col), 12 if col == "status" else 0))
        table.add_column(col, overflow="fold", min_width=widths[-1])
    for row in rows:
        table.add_row(*row)
    if sum(widths) + 3 * len(widths) + 1 <= out.width:  # each column: a rule and a space either side
        out.print(table)
    else:  # too narrow for whole names in a table (80 columns; a pipe): one variant per line, its details below
        _say(out, title)
        for row in rows:
            _say(out, row[0].plain)
            details = [Text.assemble(f"{name}: " if name != "target" else "", cell)
                       for name, cell in zip(LIST_COLUMNS[1:], row[1:])]
            out.print(Text("    ") + Text("  ").join(details), soft_wrap=True, highlight=False)
    gone = sum(1 for t in states.values() if t.plain == "kernels gone")
    if gone:
        _say(out, ("kernels gone", "yellow"), f": {gone} units' kernels are no longer in the cache (a `dplr-gen "
             f"clean` or a removed cache); `dplr-gen build {spec}` compiles them again")
    for f in plan.refused:
        _say(out, ("refused", "dim"), f" {f.what}: {f.reason}")
    for f in (manifest or {}).get("failures", []):
        _say(out, ("failed", "red"), f" {f['unit']}: {f['error']}")


@_command()
def show(
    variant: str = typer.Argument(..., metavar="VARIANT", help="variant name (`dplr-gen list SPEC`), optionally "
                                  "with __sm_XX"),
    spec: Optional[str] = typer.Option(None, "--spec", metavar="SPEC", help="spec file or built spec name "
                                       "(default: search every spec under generated/)"),
    target: Optional[str] = typer.Option(None, "--target", metavar="ARCH", help="e.g. sm_86 (default: the "
                                         "spec's first target for this variant)"),
) -> None:
    """Print the generated Triton source of a variant for one target."""
    from .toolchain import build as b
    from .tools import sources

    name, _, suffix = variant.partition("__")
    target = target or suffix or None
    if target and not target.startswith("sm_"):
        target = f"sm_{target}"
    spec_name = None
    if spec is not None:
        try:
            spec_name = b.load_spec(Path(spec)).name if Path(spec).is_file() else spec
        except SpecError as e:
            raise _fail(str(e)) from None
        if spec_name not in sources.packages(b.GENERATED):
            raise _fail(f"spec {spec_name!r} is not rendered under {b.GENERATED}; run `dplr-gen build {spec}`")
    found = sources.find(name, b.GENERATED, spec_name)
    if not found:
        where = f"spec {spec_name!r}" if spec_name else str(b.GENERATED)
        close = sources.nearest(name, b.GENERATED, spec_name)
        raise _fail(f"no variant named {name!r} in {where}; nearest: {', '.join(close) or 'none built'} "
                    "(`dplr-gen list SPEC` lists them all)")
    with_target = [f for f in found if target is None or target in f.targets]
    if not with_target:
        built = "; ".join(f"{f.spec}: {', '.join(f.targets)}" for f in found)
        raise _fail(f"{name} is not rendered for {target}; it is for {built}")
    if len(with_target) > 1:
        listing = "; ".join(f"{f.spec} ({f.spec_file}: {', '.join(f.targets)})" for f in with_target)
        raise _fail(f"{name} is in {len(with_target)} specs: {listing}. Choose one with --spec "
                    f"(e.g. --spec {with_target[0].spec_file}) or --target")
    (f,) = with_target
    tgt = target or next(iter(f.targets))
    others = [t for t in f.targets if t != tgt]
    _say(err, f"# {f.spec} ({f.spec_file}), {tgt}" + (f"; also rendered for {', '.join(others)} (--target)"
                                                      if others else ""))
    sys.stdout.write(f.targets[tgt].read_text())


@_command()
def doctor() -> None:
    """Versions of Triton, torch and ptxas, the GPU seen, the cache, the settings, the specs found."""
    from importlib.metadata import PackageNotFoundError, version

    from .toolchain.cache import cache_root
    from .runtime.loader import GENERATED, KEEP_STUBS_ENV, keeps_stubs

    rows: list[tuple[str, str | Text]] = [("python", f"{platform.python_version()} ({sys.executable})")]
    for dist in ("triton", "torch", "pydantic", "jinja2"):
        try:
            rows.append((dist, version(dist)))
        except PackageNotFoundError:
            rows.append((dist, Text("not installed", style="red")))
    rows.append(("ptxas", _ptxas_version()))
    rows.append(("GPU", _gpus()))
    rows.append(("cache", _or_problem(lambda: str(cache_root()))))
    try:
        from .toolchain.launch_stubs import kept_driver_modules
        from .toolchain.triton_versions import triton_version

        from .toolchain.launch_direct import kept_records

        tv = str(triton_version())
        rows.append(("launch stubs", f"{kept_driver_modules(cache_root(), tv)} kept for this Triton in the cache, "
                     f"{kept_records(cache_root(), tv)} kernels launched without Triton"
                     + ("" if keeps_stubs() else f" ({KEEP_STUBS_ENV}=0: not used)")))
    except Exception as e:  # doctor reports, it does not fail
        rows.append(("launch stubs", f"unknown ({e})"))
    rows.append(("settings", _settings_state()))
    specs_dir = GENERATED.parent / "specs"
    rows.append(("spec files", ", ".join(p.name for p in sorted(specs_dir.glob("*.yaml"))) or "none"))
    rows.append((f"specs under {GENERATED.name}/", _generated_specs(GENERATED)))
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value")
    for what, value in rows:  # values are paths, versions, library text: never markup
        table.add_row(Text(what), value if isinstance(value, Text) else Text(value))
    out.print(table)


def _or_problem(value: Callable[[], str]) -> str | Text:
    try:
        return value()
    except settings.SettingError as e:  # doctor reports, it does not fail
        return Text(str(e), style="red")


def _settings_state() -> Text:
    """Each DPLR_GEN_* variable set, with what is wrong with it; DPLR_GEN_SPEC as the run time finds it."""
    from .runtime.loader import GENERATED, SPEC_ENV, all_packages

    lines = []
    for name in sorted(n for n in os.environ if n.startswith(settings.PREFIX)):
        line = Text(f"{name}={os.environ[name]!r}: ok")
        problem = next((u for u in settings.unknown() if u.startswith(f"{name} ")), "")
        try:
            if not problem and name == SPEC_ENV:
                all_packages(GENERATED)
            elif not problem:
                settings.check(name)
        except Exception as e:  # doctor reports, it does not fail
            problem = str(e)
        lines.append(Text(problem, style="red") if problem else line)  # a problem names the variable and value
    return Text("\n").join(lines) if lines else Text("none set (DPLR_GEN_NO_JIT unset: run-time JIT allowed)")


def _gpus() -> str:
    try:
        import torch

        if not torch.cuda.is_available():
            return "none seen (building works without one; TRITON_INTERPRET=1 runs ops on CPU)"
        return "; ".join(
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        )
    except ImportError:
        return "torch not installed"


def _generated_specs(root: Path) -> str:
    """The specs under generated/, each with whether it is built here for this Triton, in the words that the
    run time's errors use (SpecPackage.build_state)."""
    from .runtime.loader import all_packages

    try:
        pkgs = all_packages(root, check_setting=False)
    except Exception as e:  # doctor reports, it does not fail
        return f"unreadable ({e})"
    return "; ".join(f"{p.name} ({p.build_state()})" for p in pkgs) or "none"


def _ptxas_version() -> str:
    try:
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        exe = str(path) if path.exists() else shutil.which("ptxas")
        if not exe:
            return "not found"
        res = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20)
        return res.stdout.strip().splitlines()[-1] + f" ({exe})"
    except Exception as e:  # doctor reports, it does not fail
        return f"unknown ({e})"


@_command()
def clean(
    spec: Optional[Path] = typer.Argument(None, metavar="SPEC", help="spec file whose build products to remove"),
    everything: bool = typer.Option(False, "--all", help="remove the whole kernel cache (every spec's kernels, every "
                                    "Triton release, on-demand variants, launch stubs) and every manifest under "
                                    "generated/"),
) -> None:
    """Remove build products: a spec's manifest and the cached kernels no other built spec uses; --all: the whole
    cache. Rendered sources stay. (Kernels are cached by content, so specs share them.)"""
    from .toolchain import build as b
    from .toolchain import clean as c
    from .toolchain.cache import cache_root

    if spec is None and not everything:
        size = c.measure(cache_root())
        raise _fail(f"name the spec to clean (`dplr-gen clean specs/<arch>.yaml`), or pass --all to remove the whole "
                    f"kernel cache {cache_root()} ({_cache_size(size)}) and every manifest under {b.GENERATED}")
    if spec is not None and everything:
        raise _fail("give a SPEC or --all, not both")
    if spec is None:
        size = c.remove_all(cache_root(), b.GENERATED)
        _say(out, f"removed the kernel cache {cache_root()} ({_cache_size(size)}) and every manifest under "
                  f"{b.GENERATED}")
        return
    try:
        name = b.load_spec(spec).name
    except SpecError as e:
        raise _fail(str(e)) from None
    out_dir = b.GENERATED / name
    if not (out_dir / b.MANIFEST).is_file():
        _say(out, f"{name}: not built here (no {out_dir / b.MANIFEST}); nothing to clean")
        return
    with b.package_lock(out_dir, on_wait=lambda message: _say(err, message)):  # not while it is being built
        removed = c.clean_package(out_dir / b.MANIFEST, b.GENERATED)
    kept = f"; kept {removed.kept} that other built specs or on-demand variants use" if removed.kept else ""
    _say(out, f"{name}: removed the manifest and {removed.entries} cached kernels ({_bytes(removed.bytes)}){kept}")


@_command()
def pack(
    spec: Path = typer.Argument(..., metavar="SPEC", help="spec file whose built kernels to pack"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", metavar="FILE",
                                          help="the archive (default: <spec>-kernels-triton<release>.tar.gz here)"),
) -> None:
    """Write a built spec's kernels (metadata and binaries, for this build's Triton release) to one archive; on
    another machine with that release, `dplr-gen unpack FILE` then `dplr-gen build SPEC` compiles nothing."""
    from .toolchain import build as b
    from .toolchain import kernel_pack

    try:
        name = b.load_spec(spec).name
    except SpecError as e:
        raise _fail(str(e)) from None
    out_dir = b.GENERATED / name
    manifest = b.read_manifest(out_dir)
    if manifest is None:
        raise _fail(f"{name}: not built here (no {out_dir / b.MANIFEST}); run `dplr-gen build {spec}` first")
    target = output or Path(f"{name}-kernels-triton{manifest['triton_version']}.tar.gz")
    with b.package_lock(out_dir, on_wait=lambda message: _say(err, message)):  # not while it is being built
        try:
            record = kernel_pack.pack(out_dir, target)
        except FileNotFoundError as e:
            raise _fail(f"{name}: {e}") from None
    _say(out, f"{name}: {record['kernels']} kernels ({', '.join(record['targets'])}; Triton "
              f"{record['triton_version']}) -> {target} ({_bytes(target.stat().st_size)})")


@_command()
def unpack(archive: Path = typer.Argument(..., metavar="FILE", help="an archive `dplr-gen pack` wrote")) -> None:
    """Add the kernels of a `dplr-gen pack` archive to this machine's kernel cache (entry by entry, atomically;
    entries already there are kept); `dplr-gen build SPEC` then finds them all and compiles none."""
    from .toolchain import kernel_pack
    from .toolchain.cache import cache_root
    from .toolchain.triton_versions import triton_version

    if not archive.is_file():
        raise _fail(f"{archive}: no such file")
    try:
        got = kernel_pack.unpack(archive, str(triton_version()))
    except (ValueError, OSError, tarfile.TarError) as e:
        raise _fail(str(e)) from None
    _say(out, f"{got.spec}: {got.added} kernels added to {cache_root()} ({got.kept} already there; Triton "
              f"{got.triton_version}); next: `dplr-gen build specs/{got.spec}.yaml` (compiles nothing)")


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    for unit, scale in (("KB", 1 << 10), ("MB", 1 << 20), ("GB", 1 << 30)):
        if n < 1024 * scale or unit == "GB":
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"  # not reached


def _cache_size(size: Any) -> str:
    releases = f"Triton {', '.join(size.releases)}" if size.releases else "no Triton release"
    return f"{size.entries} entries, {_bytes(size.bytes)}, {releases}"


@_command()
def compat(
    triton: Optional[str] = typer.Option(
        None, "--triton", metavar="VERSIONS", help="Triton releases, comma-separated, e.g. 3.1.0,3.2.0,3.6.0 (default: the latest "
        "patch of each minor 3.1 to 3.9 on the package index)"),
    specs: Optional[list[str]] = typer.Option(
        None, "--specs", metavar="SPECS", help="spec files (default: every specs/*.yaml); `--specs A B`, `--specs A,B` or "
        "repeated --specs"),
    extra_specs: Optional[list[str]] = typer.Argument(None, hidden=True, metavar="[SPEC]..."),
    sample: bool = typer.Option(
        True, "--sample/--full", help="sample: per (spec, arch, Triton) one variant per family (op, gate mode, "
        "dtype, gate dtype, varlen) at the largest head dim; full: every variant"),
    pairwise: bool = typer.Option(
        False, "--pairwise", help="with --sample: of the families that differ only in the gate's dtype, one, so that "
        "every pair of (gate mode, varlen, gate dtype) values still meets per (arch, op, dtype): about two thirds "
        "of the compile time (CI's oldest releases)"),
    jobs: int = typer.Option(os.cpu_count() or 2, "--jobs", "-j", min=1, metavar="N", help="compiles run in parallel"),
    targets: Optional[str] = typer.Option(None, "--targets", metavar="ARCHS", help="only these archs, e.g. sm_80,sm_90"),
    ops: Optional[str] = typer.Option(None, "--ops", metavar="OPS", help="only these ops: chunk, fused_recurrent"),
    dtypes: Optional[str] = typer.Option(None, "--dtypes", metavar="DTYPES", help="only these dtypes: bf16, fp16, fp32"),
    out_dir: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="where compat.md and compat.json go "
                                           "(default: docs/ of this repository)"),
    kernel_cache: Optional[Path] = typer.Option(
        None, "--kernel-cache", metavar="DIR", help="keep compiled kernels here across runs (default: a temporary folder, so "
        "every kernel is compiled and checked afresh and the user's cache is untouched)"),
    reuse: Optional[Path] = typer.Option(
        None, "--reuse", metavar="FILE", help="a previous matrix's compat.json (e.g. docs/compat.json): a unit whose "
        "rendered source, arch and release it records as built keeps that result instead of being compiled again "
        "(after a template change, only the units whose source changed compile)"),
    timeout: float = typer.Option(900.0, "--timeout", metavar="SECONDS", help="seconds per unit before its compile counts as FAILED"),
    check: bool = typer.Option(False, "--check", help="build nothing: exit 1 if docs/compat.json (or --out's) no longer "
                               "matches the templates, quirk registry and specs in the tree"),
) -> None:
    """Build every spec under several Triton releases (one venv each) and write docs/compat.md + .json."""
    import shlex

    from .tools import compat as c

    if check:
        path = (out_dir or c.DOCS_DIR) / "compat.json"
        if not path.is_file():
            raise _fail(f"no {path}: run `dplr-gen compat --full` to write the compatibility matrix")
        data = json.loads(path.read_text())
        why = c.staleness(data)
        if why:
            _say(err, f"{path} is stale:\n  " + "\n  ".join(why) + "\nregenerate it with: " + c.rerun_command(data))
            raise typer.Exit(EXIT_BUILD_FAILED)
        # current, but a cell failed: the templates do not compile somewhere the specs promise (fix the template,
        # or record the failure in the quirk registry so the cell is refused with its reason)
        failed = _say_failed_cells(data.get("cells", []))
        if failed:
            _say(err, f"{path} matches the tree but {failed} of its cells failed to build")
            raise typer.Exit(EXIT_BUILD_FAILED)
        _say(out, f"{path} matches the templates, quirk registry and specs, and every cell built or was refused")
        return

    spec_args = [x for s in [*(specs or []), *(extra_specs or [])] for x in s.split(",") if x]
    spec_paths = [Path(x) for x in spec_args] or sorted(c.SPECS_DIR.glob("*.yaml"))
    missing = [str(p) for p in spec_paths if not p.is_file()]
    if missing:
        raise _fail(f"no such spec file: {', '.join(missing)}")
    try:
        if triton:
            versions = c.parse_versions(triton)
        else:
            versions = c.default_versions(c.available_triton_versions())
    except (ValueError, RuntimeError) as e:
        raise _fail(str(e)) from None
    known_ops = {"chunk", "fused_recurrent"}
    op_list = [x for x in (ops or "").split(",") if x] or None
    if op_list and set(op_list) - known_ops:
        raise _fail(f"unknown op(s) {sorted(set(op_list) - known_ops)}; ops are {sorted(known_ops)}")
    dtype_list = [x for x in (dtypes or "").split(",") if x] or None
    if dtype_list and set(dtype_list) - {"bf16", "fp16", "fp32"}:
        raise _fail(f"unknown dtype(s) {sorted(set(dtype_list) - {'bf16', 'fp16', 'fp32'})}; dtypes are bf16, fp16, fp32")
    target_list = [x if x.startswith("sm_") else f"sm_{x}" for x in (targets or "").split(",") if x] or None
    # the exact command, normalized: what the header of docs/compat.md says to rerun
    if reuse is not None:
        if not reuse.is_file():
            raise _fail(f"--reuse {reuse}: no such file (a compat.json that `dplr-gen compat` wrote)")
        try:
            c.read_matrix(reuse)
        except ValueError as e:
            raise _fail(f"--reuse: {e}") from None
    if pairwise and not sample:
        raise _fail("--pairwise thins the sample: it does not go with --full")
    words = ["dplr-gen", "compat", "--sample" if sample else "--full"]
    words += ["--pairwise"] if pairwise else []
    words += ["--triton", ",".join(map(str, versions))] if triton else []
    words += ["--specs", *spec_args] if spec_args else []
    words += ["--targets", ",".join(target_list)] if target_list else []
    words += ["--ops", ",".join(op_list)] if op_list else []
    words += ["--dtypes", ",".join(dtype_list)] if dtype_list else []
    words += ["--jobs", str(jobs)]
    words += ["--timeout", f"{timeout:g}"] if timeout != 900.0 else []
    words += ["--kernel-cache", str(kernel_cache)] if kernel_cache else []
    words += ["--reuse", str(reuse)] if reuse else []
    words += ["--out", str(out_dir)] if out_dir else []
    command = shlex.join(words) + ("" if triton else f"{c.RELEASES_NOTE}{', '.join(map(str, versions))})")
    _say(err, f"compat: Triton {', '.join(map(str, versions))}; specs {', '.join(map(str, spec_paths))}; "
         f"{('pairwise sample' if pairwise else 'sample') if sample else 'full'}; {jobs} jobs")
    opts = c.Options(
        specs=spec_paths, versions=versions, sample=sample, pairwise=pairwise, jobs=jobs, targets=target_list, ops=op_list,
        dtypes=dtype_list,
        kernel_cache=kernel_cache, timeout=timeout, command=command, reuse=reuse,
    )
    try:
        data = c.run(opts, log=lambda m: _say(err, m),
                     checkpoint=lambda partial: c.write_outputs(partial, out_dir or c.DOCS_DIR))
    except SpecError as e:
        raise _fail(str(e)) from None
    j, md = c.write_outputs(data, out_dir or c.DOCS_DIR)
    counts: dict[str, int] = {}
    for cell in data["cells"]:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    _say_failed_cells(data["cells"])
    _say(out, f"{len(data['cells'])} cells: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
         + f"; {data['wall_seconds']:.0f} s -> {md}, {j}")
    if c.any_failed(data):
        raise typer.Exit(EXIT_BUILD_FAILED)


def _say_failed_cells(cells: list[dict]) -> int:
    """A FAILED line on stderr for each failed cell of a compatibility matrix; how many there were."""
    from .tools import compat as c

    failed = [cell for cell in cells if cell["status"] == "failed"]
    for cell in failed:
        _say(err, ("FAILED", "bold red"), f" {cell['spec']} {cell['target']} Triton {cell['triton']}: "
             f"{c._short_error(cell.get('error') or '', 400)}")
    return len(failed)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

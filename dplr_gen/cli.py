"""The ``dplr-gen`` command. Exit codes: 0 ok, 1 build failure (or stale with --check), 2 bad spec or usage,
130 interrupted (Ctrl-C)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand, TyperGroup
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .spec.models import SpecError


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


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _command(name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return app.command(name, cls=_Command)


class _BuildProgress:
    """The build's bar, shown once the compiles start (not while rendering, waiting for a lock, or failing)."""

    def __init__(self, spec: Path) -> None:
        self.spec = spec
        self.progress: Progress | None = None
        self.task: Any = None

    def step(self, unit: str, done: int, total: int) -> None:
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("units"),
                TimeElapsedColumn(), TextColumn("{task.fields[unit]}"), console=err, transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task(f"compiling {self.spec}", total=total, unit="")
        self.progress.update(self.task, completed=done, total=total, unit=unit)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


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
                err.print(f"[red]stale:[/] {len(stale)} file(s) under {plan.out_dir} differ from {spec}:")
                for rel in stale[:20]:
                    err.print(f"  {rel}")
                err.print(f"run `dplr-gen build {spec}` and commit generated/")
                raise typer.Exit(EXIT_BUILD_FAILED)
            out.print(f"{plan.out_dir} is up to date with {spec} ({len(plan.units)} units)")
            return
        bar = _BuildProgress(spec)
        try:
            report = b.build(spec, jobs=jobs, force=force, on_progress=bar.step,
                             on_wait=lambda message: err.print(message, highlight=False, soft_wrap=True))
        finally:
            bar.stop()
    except SpecError as e:
        raise _fail(str(e)) from None
    except b.BuildInterrupted as e:
        err.print(f"interrupted: {len(e.done)} of {e.total} units were compiled, their kernels kept in the cache "
                  f"({e.cache_root}); the running compiles were stopped. Rerun `dplr-gen build {spec}` to resume: "
                  "finished kernels are not compiled again.", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except KeyboardInterrupt:
        err.print(f"interrupted before any compile; rerun `dplr-gen build {spec}` to build.", highlight=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    for f in report.failures:
        err.print(f"[bold red]FAILED[/] {f.unit} ({f.target}): {f.error}", highlight=False)
    out.print(f"{report.spec}: {_summary(report)}; {len(report.refused)} refused or filtered "
              f"(`dplr-gen list {spec}` says why); {report.seconds:.1f} s -> {report.out_dir}", highlight=False,
              soft_wrap=True)
    if report.stubs:
        out.print(f"{report.spec}: {report.stubs}")
    if report.failures:
        raise typer.Exit(EXIT_BUILD_FAILED)


def _summary(report: Any) -> str:
    """What the build did, in the units `dplr-gen list` counts (a unit: one variant for one target) and the
    kernels they hold (several per chunk unit: one per pass)."""
    if report.up_to_date:
        return f"up to date, nothing to do ({report.units} units built)"
    ok = report.units - len(report.failures)
    how = "compiled (cache bypassed: --force)" if report.recompiled else "compiled or found in the kernel cache"
    return f"{ok} of {report.units} units built ({report.kernels} kernels {how}); {len(report.failures)} failed"


@_command("list")
def list_(spec: Path = typer.Argument(..., metavar="SPEC", help="spec file")) -> None:
    """Variants, targets, build status and shared memory used."""
    from .toolchain import build as b

    try:
        plan = b.plan(spec)
    except SpecError as e:
        raise _fail(str(e)) from None
    manifest = b.read_manifest(plan.out_dir) or {"units": {}, "failures": []}
    failed = {f["unit"]: f["error"] for f in manifest.get("failures", [])}
    stale = set(b.stale_files(plan))
    table = Table(title=f"{plan.spec.name}: {len(plan.units)} units, Triton {plan.triton_version}")
    table.add_column("variant", overflow="fold")  # names spell every parameter: never cut them
    for col in ("target", "status", "shared mem", "warps", "quirks avoided"):
        table.add_column(col)
    for u in plan.units:
        rec = manifest["units"].get(u.name)
        if plan.unit_files[u.name] in stale:
            status = "[yellow]not rendered[/]"
        elif rec:
            status = "[green]built[/]"
        elif u.name in failed:
            status = "[red]failed[/]"
        else:
            status = "not built"
        shared = f"{max(k['shared'] for k in rec['kernels'])} / {u.arch.smem_per_block}" if rec else "-"
        warps = ",".join(str(k["num_warps"]) for k in rec["kernels"]) if rec else "-"
        table.add_row(u.variant.name, u.target, status, shared, warps, ",".join(u.quirks) or "-")
    out.print(table)
    for f in plan.refused:
        out.print(f"[dim]refused[/] {f.what}: {f.reason}", highlight=False)
    for unit, error in failed.items():
        out.print(f"[red]failed[/] {unit}: {error}", highlight=False)


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
    err.print(f"# {f.spec} ({f.spec_file}), {tgt}" + (f"; also rendered for {', '.join(others)} (--target)"
              if others else ""), highlight=False, soft_wrap=True)
    sys.stdout.write(f.targets[tgt].read_text())


@_command()
def doctor() -> None:
    """Versions of Triton, torch and ptxas, the GPU seen, the cache, the specs found."""
    from importlib.metadata import PackageNotFoundError, version

    from .toolchain.cache import cache_root
    from .runtime.loader import GENERATED, KEEP_STUBS_ENV, keeps_stubs

    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("python", f"{platform.python_version()} ({sys.executable})")
    for dist in ("triton", "torch", "pydantic", "jinja2"):
        try:
            table.add_row(dist, version(dist))
        except PackageNotFoundError:
            table.add_row(dist, "[red]not installed[/]")
    table.add_row("ptxas", _ptxas_version())
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [
                f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                for i in range(torch.cuda.device_count())
            ]
            table.add_row("GPU", "; ".join(gpus))
        else:
            table.add_row("GPU", "none seen (building works without one; TRITON_INTERPRET=1 runs ops on CPU)")
    except ImportError:
        table.add_row("GPU", "torch not installed")
    table.add_row("cache", str(cache_root()))
    try:
        from .toolchain.launch_stubs import kept_driver_modules
        from .toolchain.triton_versions import triton_version

        table.add_row("launch stubs", f"{kept_driver_modules(cache_root(), str(triton_version()))} kept for this "
                      f"Triton in the cache" + ("" if keeps_stubs() else f" ({KEEP_STUBS_ENV}=0: not used)"))
    except Exception as e:  # doctor reports, it does not fail
        table.add_row("launch stubs", f"unknown ({e})")
    table.add_row("DPLR_GEN_NO_JIT", os.environ.get("DPLR_GEN_NO_JIT", "unset (run-time JIT allowed)"))
    specs_dir = GENERATED.parent / "specs"
    table.add_row("specs", ", ".join(p.name for p in sorted(specs_dir.glob("*.yaml"))) or "none")
    built = []
    for p in sorted(GENERATED.glob("*/index.json")):
        m = p.parent / "manifest.json"
        state = json.loads(m.read_text())["triton_version"] if m.exists() else "not built here"
        built.append(f"{p.parent.name} (built with Triton {state})" if m.exists() else f"{p.parent.name} ({state})")
    table.add_row("generated", ", ".join(built) or "none")
    out.print(table)


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
    spec: Optional[Path] = typer.Argument(None, metavar="SPEC", help="spec file; without it, every spec and the whole cache"),
) -> None:
    """Remove build products: the manifest(s) and the cached kernels they name. Rendered sources stay."""
    from .toolchain import build as b
    from .toolchain.cache import cache_root, entry_dir

    if spec is None:
        root = cache_root()
        shutil.rmtree(root, ignore_errors=True)
        for m in b.GENERATED.glob(f"*/{b.MANIFEST}"):
            m.unlink()
        out.print(f"removed the cache {root} and every manifest under {b.GENERATED}")
        return
    try:
        plan = b.plan(spec)
    except SpecError as e:
        raise _fail(str(e)) from None
    manifest = b.read_manifest(plan.out_dir)
    removed = 0
    if manifest:
        root = Path(manifest.get("cache_root") or cache_root())
        for unit in manifest["units"].values():
            for k in unit["kernels"]:
                d = entry_dir(k["key"], manifest["triton_version"], root)
                if d.exists():
                    shutil.rmtree(d)
                    removed += 1
        (plan.out_dir / b.MANIFEST).unlink(missing_ok=True)
    out.print(f"{plan.spec.name}: removed the manifest and {removed} cached kernels")


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
        "dtype, varlen) at the largest head dim; full: every variant"),
    jobs: int = typer.Option(os.cpu_count() or 2, "--jobs", "-j", min=1, metavar="N", help="compiles run in parallel"),
    targets: Optional[str] = typer.Option(None, "--targets", metavar="ARCHS", help="only these archs, e.g. sm_80,sm_90"),
    ops: Optional[str] = typer.Option(None, "--ops", metavar="OPS", help="only these ops: chunk, fused_recurrent"),
    dtypes: Optional[str] = typer.Option(None, "--dtypes", metavar="DTYPES", help="only these dtypes: bf16, fp16, fp32"),
    out_dir: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="where compat.md and compat.json go "
                                           "(default: docs/ of this repository)"),
    kernel_cache: Optional[Path] = typer.Option(
        None, "--kernel-cache", metavar="DIR", help="keep compiled kernels here across runs (default: a temporary folder, so "
        "every kernel is compiled and checked afresh and the user's cache is untouched)"),
    timeout: float = typer.Option(900.0, "--timeout", metavar="SECONDS", help="seconds per unit before its compile counts as FAILED"),
    check: bool = typer.Option(False, "--check", help="build nothing: exit 1 if docs/compat.json (or --out's) no longer "
                               "matches the templates, quirk registry and specs in the tree"),
) -> None:
    """Build every spec under several Triton releases (one venv each) and write docs/compat.md + .json."""
    import json
    import shlex

    from .tools import compat as c

    if check:
        path = (out_dir or c.DOCS_DIR) / "compat.json"
        if not path.is_file():
            raise _fail(f"no {path}: run `dplr-gen compat --full` to write the compatibility matrix")
        data = json.loads(path.read_text())
        why = c.staleness(data)
        if why:
            err.print(f"{path} is stale:\n  " + "\n  ".join(why) + "\nregenerate it with: "
                      + data.get("command", "dplr-gen compat --full").split("  (")[0], markup=False, highlight=False,
                      soft_wrap=True)
            raise typer.Exit(EXIT_BUILD_FAILED)
        out.print(f"{path} matches the templates, quirk registry and specs", markup=False, highlight=False)
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
    words = ["dplr-gen", "compat", "--sample" if sample else "--full"]
    words += ["--triton", ",".join(map(str, versions))] if triton else []
    words += ["--specs", *spec_args] if spec_args else []
    words += ["--targets", ",".join(target_list)] if target_list else []
    words += ["--ops", ",".join(op_list)] if op_list else []
    words += ["--dtypes", ",".join(dtype_list)] if dtype_list else []
    words += ["--jobs", str(jobs)]
    words += ["--timeout", f"{timeout:g}"] if timeout != 900.0 else []
    words += ["--kernel-cache", str(kernel_cache)] if kernel_cache else []
    words += ["--out", str(out_dir)] if out_dir else []
    command = shlex.join(words) + ("" if triton else f"  (default releases: {', '.join(map(str, versions))})")
    err.print(f"compat: Triton {', '.join(map(str, versions))}; specs {', '.join(map(str, spec_paths))}; "
              f"{'sample' if sample else 'full'}; {jobs} jobs", highlight=False, soft_wrap=True)
    opts = c.Options(
        specs=spec_paths, versions=versions, sample=sample, jobs=jobs, targets=target_list, ops=op_list,
        dtypes=dtype_list,
        kernel_cache=kernel_cache, timeout=timeout, command=command,
    )
    try:
        data = c.run(opts, log=lambda m: err.print(m, highlight=False, markup=False, soft_wrap=True),
                     checkpoint=lambda partial: c.write_outputs(partial, out_dir or c.DOCS_DIR))
    except SpecError as e:
        raise _fail(str(e)) from None
    j, md = c.write_outputs(data, out_dir or c.DOCS_DIR)
    counts: dict[str, int] = {}
    for cell in data["cells"]:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
        if cell["status"] == "failed":
            err.print(f"[bold red]FAILED[/] {cell['spec']} {cell['target']} Triton {cell['triton']}: "
                      f"{c._short_error(cell['error'], 400)}", highlight=False, soft_wrap=True)
    out.print(f"{len(data['cells'])} cells: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
              + f"; {data['wall_seconds']:.0f} s -> {md}, {j}", highlight=False, soft_wrap=True)
    if c.any_failed(data):
        raise typer.Exit(EXIT_BUILD_FAILED)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

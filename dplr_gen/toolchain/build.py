"""``dplr-gen build``: spec -> build units -> rendered package under generated/ -> compiled kernels -> manifest.

The rendered files (sources, index.json, __init__.py) are deterministic and checked in; ``manifest.json`` is
the machine's record of a finished build (which cache entries hold each kernel) and is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any, Callable, Iterator

from filelock import FileLock, Timeout
from packaging.version import Version

from . import cache, clean
from .compile import Cancel, CompileOutcome, job_for, run_in_subprocess
from .package_kernels import read_manifest
from ..render.render import GENERATOR_VERSION, TEMPLATE_FOR_OP, render_template, render_unit, source_hash
from ..spec.models import Spec, load_spec
from ..plan.variants import BuildUnit, Filtered, build_units

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED = REPO_ROOT / "generated"
INDEX = "index.json"
MANIFEST = "manifest.json"
LOCK = ".lock"
LOCK_OWNER = ".lock.owner"  # the pid of the build holding LOCK (the lock file itself is truncated by waiters)
BUILD_PRODUCTS = {MANIFEST, LOCK, LOCK_OWNER}


def installed_triton() -> Version:
    return Version(dist_version("triton"))


@dataclass
class Plan:
    spec: Spec
    spec_path: Path
    out_dir: Path
    triton_version: Version
    units: list[BuildUnit]
    refused: list[Filtered]
    files: dict[str, str]  # path relative to out_dir -> text
    unit_files: dict[str, str]  # unit name -> relative source path

    @property
    def index_sha(self) -> str:
        return hashlib.sha256(self.files[INDEX].encode()).hexdigest()[:16]


def plan(spec_path: str | Path, out_root: Path | None = None, triton_version: Version | None = None) -> Plan:
    out_root = GENERATED if out_root is None else out_root
    spec_path = Path(spec_path)
    spec = load_spec(spec_path)
    tv = triton_version or installed_triton()
    units, refused = build_units(spec, tv)
    files: dict[str, str] = {}
    unit_files: dict[str, str] = {}
    variants: dict[str, Any] = {}
    for u in units:
        rel = f"{u.variant.name}/{u.target}.py"
        text = render_unit(u)
        files[rel] = text
        unit_files[u.name] = rel
        entry = variants.setdefault(u.variant.name, {"params": u.variant.params(), "targets": {}})
        entry["targets"][u.target] = {
            "unit": u.name, "source": rel, "source_hash": source_hash(text),
            "template": TEMPLATE_FOR_OP[u.variant.op], "flags": u.flags,
            "tune": {st: k.model_dump() for st, k in u.tune.items()}, "quirks": list(u.quirks),
        }
    try:
        shown_path = spec_path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        shown_path = spec_path.name
    index = {
        "spec": spec.name, "spec_file": shown_path, "description": spec.description,
        "generator_version": GENERATOR_VERSION, "triton_version": str(tv), "targets": spec.targets,
        "variants": variants, "refused": [{"what": f.what, "reason": f.reason} for f in refused],
    }
    files[INDEX] = json.dumps(index, indent=1, sort_keys=True) + "\n"
    files["__init__.py"] = render_template("package_init.py.jinja", spec=spec, spec_file=shown_path)
    return Plan(spec, spec_path, out_root / spec.name, tv, units, refused, files, unit_files)


def stale_files(p: Plan) -> list[str]:
    """Paths (relative) under out_dir that differ from what the plan renders, or should not be there."""
    stale = [rel for rel, text in p.files.items() if _read(p.out_dir / rel) != text]
    if p.out_dir.is_dir():
        for f in sorted(p.out_dir.rglob("*")):
            rel = f.relative_to(p.out_dir).as_posix()
            if f.is_file() and rel not in p.files and f.name not in BUILD_PRODUCTS and "__pycache__" not in rel:
                stale.append(rel)
    return stale


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def write_package(p: Plan) -> list[str]:
    """Bring out_dir in line with the plan; returns the paths written or removed."""
    changed = stale_files(p)
    for rel in changed:
        path = p.out_dir / rel
        if rel in p.files:
            cache.atomic_write_text(path, p.files[rel])
        else:
            path.unlink()
    for d in sorted((x for x in p.out_dir.rglob("*") if x.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    top_init = p.out_dir.parent / "__init__.py"
    if not top_init.exists():
        cache.atomic_write_text(top_init, '"""Packages built by dplr-gen, one per spec."""\n')
    return changed


@dataclass
class BuildReport:
    spec: str
    out_dir: Path
    up_to_date: bool = False
    written: list[str] = field(default_factory=list)
    outcomes: list[CompileOutcome] = field(default_factory=list)
    refused: list[Filtered] = field(default_factory=list)
    seconds: float = 0.0
    units: int = 0  # (variant, target) pairs of the plan, as `dplr-gen list` counts them
    recompiled: bool = False  # --force: every kernel compiled again, the cache bypassed
    stubs: str = ""  # what became of the launch stubs (build_launch_stubs)

    @property
    def failures(self) -> list[CompileOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def kernels(self) -> int:
        return sum(len(o.kernels) for o in self.outcomes)


class BuildInterrupted(KeyboardInterrupt):
    """Ctrl-C during the compiles: what was finished (kept in the cache) and what a rerun still does."""

    def __init__(self, spec_path: Path, done: list[str], total: int, cache_root: Path) -> None:
        super().__init__(f"build of {spec_path} interrupted after {len(done)} of {total} units")
        self.spec_path, self.done, self.total, self.cache_root = spec_path, done, total, cache_root


def manifest_is_current(p: Plan, manifest: dict[str, Any] | None, root: Path) -> bool:
    """A finished build of exactly this plan whose cache entries are all still present."""
    if not manifest or manifest.get("index_sha") != p.index_sha or manifest.get("failures"):
        return False
    if manifest.get("triton_version") != str(p.triton_version) or set(manifest["units"]) != set(p.unit_files):
        return False
    if any("declared" not in u for u in manifest["units"].values()):  # built before launch records were kept
        return False
    tv = str(p.triton_version)
    return all(
        (cache.entry_dir(k["key"], tv, root) / cache.META).exists()
        for u in manifest["units"].values() for k in u["kernels"]
    )


def build(
    spec_path: str | Path,
    jobs: int = 2,
    force: bool = False,
    out_root: Path | None = None,
    on_progress: Callable[[str, int, int, int], None] | None = None,
    stubs: bool = True,
    on_wait: Callable[[str], None] | None = None,
) -> BuildReport:
    """Render, compile and record the spec's package. ``force``: compile every kernel again, even those in the
    cache. ``on_progress(unit, done, total, failed)``: once with done = 0 before the compiles, then after each unit
    (``failed``: how many of the ``done`` failed).
    ``on_wait(message)``: called once if another build holds the package's lock (this one then waits for it)."""
    t0 = time.perf_counter()
    p = plan(spec_path, out_root)
    root = cache.cache_root()
    report = BuildReport(p.spec.name, p.out_dir, refused=p.refused, units=len(p.units))
    p.out_dir.mkdir(parents=True, exist_ok=True)
    # one build of a spec at a time; a second waits (saying so), then finds the work done
    with package_lock(p.out_dir, on_wait):
        report.written = write_package(p)
        report.up_to_date = not force and manifest_is_current(p, read_manifest(p.out_dir), root)
        if not report.up_to_date:
            _compile_and_record(p, root, jobs, report, on_progress, force)
        # the cache learns which packages use its entries, so that cleaning another spec keeps them
        clean.register(p.out_dir / MANIFEST, root)
    if stubs:
        report.stubs = build_launch_stubs(p.out_dir)
    report.seconds = time.perf_counter() - t0
    return report


def lock_holder(out_dir: Path) -> str:
    """Who holds the package's build lock, as far as is known."""
    try:
        pid = int((out_dir / LOCK_OWNER).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "by a process that has not said which (it may be starting)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"by process {pid}, which has ended (the lock is about to be free)"
    except PermissionError:
        pass
    return f"by process {pid}"


@contextmanager
def package_lock(out_dir: Path, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """The package's build lock; if another build holds it, ``on_wait`` hears which lock and whose, then this
    waits for it."""
    lock = FileLock(str(out_dir / LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait:
            on_wait(f"waiting for another build of this package: {out_dir / LOCK} is held {lock_holder(out_dir)}")
        lock.acquire()
    try:
        cache.atomic_write_text(out_dir / LOCK_OWNER, f"{os.getpid()}\n")
        yield
    finally:
        (out_dir / LOCK_OWNER).unlink(missing_ok=True)
        lock.release()


def _compile_and_record(
    p: Plan, root: Path, jobs: int, report: BuildReport, on_progress: Callable[[str, int, int, int], None] | None,
    force: bool = False,
) -> None:
    """Compile every unit (in subprocesses, ``jobs`` at once) into the cache, then write the manifest last.
    Call under the package's lock."""
    tv = str(p.triton_version)
    job_list = [job_for(u, p.out_dir / p.unit_files[u.name], p.files[p.unit_files[u.name]], root, tv, force=force)
                for u in p.units]
    report.recompiled = force
    if on_progress:
        on_progress("", 0, len(job_list), 0)
    cancel = Cancel()
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = [pool.submit(run_in_subprocess, j, cancel=cancel) for j in job_list]
        for n, fut in enumerate(as_completed(futures), 1):
            outcome = fut.result()
            report.outcomes.append(outcome)
            if on_progress:
                on_progress(outcome.unit, n, len(job_list), len(report.failures))
    except KeyboardInterrupt:
        # stop within seconds: no queued compile starts, running ones are terminated. Finished kernels are in
        # the cache (each entry written atomically), so a rerun compiles only the rest. No manifest is written.
        cancel.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        raise BuildInterrupted(p.spec_path, [o.unit for o in report.outcomes if o.ok], len(job_list), root) from None
    pool.shutdown()
    report.outcomes.sort(key=lambda o: o.unit)
    manifest = {
        "spec": p.spec.name, "index_sha": p.index_sha, "triton_version": tv,
        "generator_version": GENERATOR_VERSION, "cache_root": str(root),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "units": {o.unit: {"target": o.target, "kernels": o.kernels, "options": o.options, "declared": o.declared}
                  for o in report.outcomes if o.ok},
        "failures": [{"unit": o.unit, "target": o.target, "error": o.error} for o in report.failures],
    }
    cache.atomic_write_text(p.out_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _cuda_usable() -> bool:
    if not any(Path(d).exists() for d in ("/dev/nvidiactl", "/dev/dxg")):  # no driver: skip torch's import
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def build_launch_stubs(out_dir: Path) -> str:
    """Build the C launch stubs Triton needs for the package's kernels and keep them beside the kernels in
    dplr-gen's cache, where a fresh process finds them even with an empty Triton cache. They link against
    the CUDA driver, so this runs only where one is usable; elsewhere the first process that loads a
    variant on a GPU builds and keeps them. Returns a line for the build report."""
    if not _cuda_usable():
        return "launch stubs: no CUDA GPU here, built and kept by the first process that loads a variant on one"
    from .package_kernels import build_launch_stubs as keep_stubs

    t0 = time.perf_counter()
    n = keep_stubs(out_dir)
    return f"launch stubs: built or found for {n} kernels in {time.perf_counter() - t0:.1f} s"

"""Compiling one rendered source for one target, in a process of its own.

``python -m dplr_gen.toolchain.compile JOB.json`` compiles every kernel the source declares (its SIGNATURES, CONSTEXPRS,
LAUNCH tables), checks each result against the target (shared memory within the arch limit; no conversion
between two MMA layouts on matrix units other than mma v2), stores passing kernels in the cache and prints one
JSON result line. A compiler abort (SIGABRT, segfault) kills only this process; the parent reports it with the
unit, the target and the Triton version, and the rest of the build goes on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

RESULT_PREFIX = "DPLR_GEN_RESULT "
# printed (and flushed) before each kernel's compile, so that the parent can name the kernel an abort killed
COMPILING_PREFIX = "DPLR_GEN_COMPILING "
MMA_CONVERSION_HINT = (
    "the pattern behind \"mma -> mma layout conversion is only supported on Ampere\": a dot result flows into "
    "another dot through a conversion between MMA layouts"
)


@dataclass
class CompileJob:
    unit: str
    source: str  # path of the rendered module
    source_hash: str
    target: str
    cc: int
    smem_limit: int
    check_mma: bool
    triton_version: str
    cache_root: str
    force: bool = False  # compile even where the cache holds the kernel, and replace the entry
    kernels: list[str] | None = None  # compile only these of the source's kernels (None: all)


@dataclass
class CompileOutcome:
    unit: str
    target: str
    ok: bool
    kernels: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    failed: list[str] = field(default_factory=list)  # kernels that compiled but failed a check
    over_smem: list[str] = field(default_factory=list)  # those of them refused for their shared memory alone
    compiled: list[str] = field(default_factory=list)  # kernels this job compiled (the rest: found in the cache)
    # the unit's host-side choices (its OPTIONS) and the kernels its source declares: with each kernel's launch
    # record (in its cache entry) what the loader needs to launch the unit without importing its source
    options: dict[str, Any] = field(default_factory=dict)
    declared: list[str] = field(default_factory=list)


def job_for(unit: Any, source: str | Path, text: str, root: Path, triton_version: str,
            kernels: list[str] | None = None, force: bool = False) -> CompileJob:
    """The compile job of build unit ``unit`` (variants.BuildUnit) whose rendered ``text`` is at ``source``."""
    from ..render.render import source_hash

    return CompileJob(
        unit=unit.name, source=str(source), source_hash=source_hash(text), target=unit.target, cc=unit.arch.cc,
        smem_limit=unit.arch.smem_per_block, check_mma=unit.arch.mma != "v2", triton_version=triton_version,
        cache_root=str(root), kernels=kernels, force=force,
    )


def import_source(path: str | Path, module_name: str) -> ModuleType:
    """Import a rendered kernel module from its file (Triton needs kernels defined in real files)."""
    spec = importlib.util.spec_from_file_location(module_name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def kernel_cache_key(job_source_hash: str, name: str, module: ModuleType, cc: int, triton_version: str) -> str:
    from .cache import cache_key

    return cache_key(
        source=job_source_hash, kernel=name, signature=module.SIGNATURES[name],
        constexprs=module.CONSTEXPRS[name], launch=module.LAUNCH[name], cc=cc, triton=triton_version,
    )


def run_job(job: CompileJob) -> CompileOutcome:
    """Compile in this process (the caller made it a fresh one)."""
    from . import cache, launch, triton_compile, ttgir

    module = import_source(job.source, f"dplr_gen_build_{job.unit}")
    root = Path(job.cache_root)
    out = CompileOutcome(job.unit, job.target, ok=True, options=dict(getattr(module, "OPTIONS", {})),
                         declared=list(module.SIGNATURES))
    for name in job.kernels if job.kernels is not None else module.SIGNATURES:
        key = kernel_cache_key(job.source_hash, name, module, job.cc, job.triton_version)

        def record() -> dict[str, Any]:  # formed only after the compile is announced (a compile may abort)
            return launch.launch_record(getattr(module, name), module.SIGNATURES[name], module.CONSTEXPRS[name],
                                        module.LAUNCH[name])

        with cache.locked(key, job.triton_version, root):
            meta = None if job.force else cache.read_entry(key, job.triton_version, root)
            if meta is not None and "launch" not in meta:  # an entry stored before launch records were kept
                meta = cache.add_to_meta(key, job.triton_version, {"launch": record()}, root)
            if meta is None:
                print(COMPILING_PREFIX + name, flush=True)
                t0 = time.perf_counter()
                try:
                    options = dict(module.LAUNCH[name])  # num_warps, num_stages, then compiler options (maxnreg)
                    res = triton_compile.compile_kernel(
                        getattr(module, name), module.SIGNATURES[name], module.CONSTEXPRS[name], job.cc,
                        options.pop("num_warps"), options.pop("num_stages"), options,
                        divisible_args=getattr(module, "DIVISIBLE", {}).get(name, ()),
                    )
                except Exception as e:
                    e.dplr_gen_kernel = name  # type: ignore[attr-defined]
                    raise
                seconds = time.perf_counter() - t0
                problems = []
                if res.shared > job.smem_limit:
                    problems.append(
                        f"uses {res.shared} B of shared memory; {job.target} allows {job.smem_limit} B per block "
                        "(lower block_v/num_stages for this stage in the spec's tuning)"
                    )
                if job.check_mma:
                    conv = ttgir.mma_conversions(res.ttgir)
                    if conv:
                        problems.append(
                            f"TTGIR holds {len(conv)} conversion(s) between MMA layouts, {MMA_CONVERSION_HINT}: "
                            + conv[0].strip()[:300]
                        )
                if problems:  # the other kernels are still compiled: every failing one is named
                    out.ok = False
                    out.failed.append(name)
                    if len(problems) == 1 and res.shared > job.smem_limit:
                        out.over_smem.append(name)
                    out.error = "; ".join(filter(None, [out.error, f"kernel {name}: " + "; ".join(problems)]))
                    continue
                meta = {
                    "kernel": name, "key": key, "unit": job.unit, "target": job.target,
                    "shared": res.shared, "num_warps": module.LAUNCH[name]["num_warps"],
                    "num_stages": module.LAUNCH[name]["num_stages"], "compile_s": round(seconds, 3),
                    "triton_version": job.triton_version, "source_hash": job.source_hash,
                    "ttgir_sha256": hashlib.sha256(res.ttgir.encode()).hexdigest()[:16],
                    "triton_metadata": res.metadata, "launch": record(),
                }
                cache.write_entry(key, job.triton_version, res.files, meta, root, replace=job.force)
                out.compiled.append(name)
            out.kernels.append({k: meta[k] for k in meta if k not in ("triton_metadata", "launch")})
    return out


REPO_ROOT = Path(__file__).resolve().parents[2]


class Cancel:
    """Stops a build's compiles: no new one starts once set, and the running ones are terminated (each is a
    process of its own, and a compile can take minutes). Thread-safe."""

    def __init__(self) -> None:
        self._set = False
        self._procs: set[subprocess.Popen[str]] = set()
        self._lock = threading.Lock()

    def is_set(self) -> bool:
        return self._set

    def cancel(self) -> None:
        with self._lock:
            self._set = True
            procs = list(self._procs)
        for p in procs:
            p.terminate()

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str] | None:
        """The started process, or None once cancelled (a process started as cancel() runs is terminated)."""
        with self._lock:
            if self._set:
                return None
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            self._procs.add(proc)
            return proc

    def done(self, proc: subprocess.Popen[str]) -> None:
        with self._lock:
            self._procs.discard(proc)


def run_in_subprocess(job: CompileJob, timeout: float = 900.0, python: str = sys.executable,
                      cancel: Cancel | None = None) -> CompileOutcome:
    """Run a job in a fresh interpreter; a crash there becomes an error outcome here.

    ``python``: the interpreter to compile with, e.g. one of a virtual environment holding another Triton
    release (``dplr-gen compat``). It needs only triton, filelock, platformdirs and packaging: the repository
    root goes on its PYTHONPATH so that it imports this package from here. ``cancel``: once set, the job is
    not started, or its process is terminated (the outcome then says it was cancelled).
    """
    cancel = cancel or Cancel()
    where = f"{job.unit} for {job.target} with Triton {job.triton_version}"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(asdict(job), f)
        job_path = f.name
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiling needs the real compiler
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = cancel.start([python, "-m", "dplr_gen.toolchain.compile", job_path], env)
        if proc is None:
            return CompileOutcome(job.unit, job.target, False, error=f"compiling {where} was cancelled")
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return CompileOutcome(job.unit, job.target, False,
                                  error=f"compiling {where} timed out after {timeout:.0f} s")
        finally:
            cancel.done(proc)
    finally:
        os.unlink(job_path)
    if cancel.is_set():
        return CompileOutcome(job.unit, job.target, False, error=f"compiling {where} was cancelled")
    lines = stdout.splitlines()
    for line in reversed(lines):
        if line.startswith(RESULT_PREFIX):
            return CompileOutcome(**json.loads(line[len(RESULT_PREFIX):]))
    kernel = next((ln[len(COMPILING_PREFIX):] for ln in reversed(lines) if ln.startswith(COMPILING_PREFIX)), None)
    if kernel:
        where = f"kernel {kernel} of {where}"
    tail = "\n".join((stderr or stdout).strip().splitlines()[-6:])
    how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with {proc.returncode}"
    if proc.returncode in (-6, 134):
        how = "aborted inside the compiler (SIGABRT)"
    return CompileOutcome(job.unit, job.target, False, error=f"the compiler {how} compiling {where}:\n{tail}")


def _kernel_of(e: BaseException) -> str:
    name = getattr(e, "dplr_gen_kernel", None)
    return f"kernel {name} of " if name else ""


def main(argv: list[str]) -> int:
    job = CompileJob(**json.loads(Path(argv[0]).read_text()))
    try:
        outcome = run_job(job)
    except Exception as e:  # a Python-level compiler error: report it, do not die silently
        outcome = CompileOutcome(
            job.unit, job.target, False,
            error=f"compiling {_kernel_of(e)}{job.unit} for {job.target} with Triton {job.triton_version} failed: "
            f"{type(e).__name__}: {str(e).strip()[:2000]}",
        )
    print(RESULT_PREFIX + json.dumps(asdict(outcome)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

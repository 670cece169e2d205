"""``dplr-gen compat``: build every spec under a list of Triton releases and write the compatibility matrix.

For each Triton release a virtual environment holding only that release (and the four small packages the
compile step imports) is created on demand under ``<cache root>/venvs/triton-<version>``; the installed Triton
is used as is. For each (spec, release) the spec is planned *for that release* (quirk flags, warp caps and
refusals come from the registry for it), the units are rendered into a temporary folder, and each unit is
compiled and verified by ``python -m dplr_gen.toolchain.compile`` run with that environment's interpreter, one
subprocess per unit. A compiler abort ends one subprocess and becomes a FAILED cell, never the command.

Outcome per (spec, arch, release):
  * ``built``: every compiled unit passed the compile and the checks (shared memory, no MMA->MMA conversion
    on wgmma/tcgen05);
  * ``built, quirks avoided: <ids>``: the same, for units rendered under active registry entries;
  * ``refused: <reason>``: the registry says nothing avoids a failure there; nothing was attempted;
  * ``FAILED: <error>``: a compile error, a failed check, an abort, a timeout, or an environment that
    could not be made.

``docs/compat.json`` holds the raw result; ``docs/compat.md`` is rendered from it (:func:`render_markdown`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from packaging.version import InvalidVersion, Version

from ..spec import quirks as quirk_registry
from ..spec.arch import get_arch
from ..spec.models import SpecError
from ..toolchain.cache import cache_root
from ..toolchain.compile import CompileJob, CompileOutcome, run_in_subprocess
from ..render.render import TEMPLATES_DIR, source_hash
from ..plan.variants import BuildUnit, expand, unit_for

REPO_ROOT = Path(__file__).resolve().parents[2]
SPECS_DIR = REPO_ROOT / "specs"
QUIRKS_FILE = Path(quirk_registry.__file__).resolve().parent / "data" / "quirks.yaml"
DOCS_DIR = REPO_ROOT / "docs"
MINORS = tuple(range(1, 10))  # Triton 3.1 .. 3.9: the releases triton_compat speaks to
# What `python -m dplr_gen.toolchain.compile` imports besides the standard library is triton, filelock, platformdirs
# and packaging; pyyaml and pydantic come along so the environment can also plan if ever needed.
VENV_PACKAGES = ("filelock", "platformdirs", "packaging", "pyyaml", "pydantic")
READY = ".dplr-gen-ready"
SCHEMA = 1

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ----------------------------------------------------------------------------------------------------------
# Triton releases and their environments


def available_triton_versions(python: str = sys.executable) -> list[Version]:
    """Triton releases the package index offers (``pip index versions triton``), newest first."""
    proc = subprocess.run(
        [python, "-m", "pip", "index", "versions", "triton"], capture_output=True, text=True, timeout=300
    )
    m = re.search(r"Available versions:\s*(.+)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise RuntimeError(
            "could not list Triton releases with `pip index versions triton` "
            f"(exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-500:]}; pass --triton explicitly"
        )
    out = []
    for s in m.group(1).split(","):
        try:
            out.append(Version(s.strip()))
        except InvalidVersion:
            continue
    return sorted(out, reverse=True)


def default_versions(available: Iterable[Version]) -> list[Version]:
    """The latest final patch release of each minor 3.1 .. 3.9 among ``available``, oldest first."""
    best: dict[int, Version] = {}
    for v in available:
        if v.is_prerelease or v.is_devrelease or v.local or v.release[0] != 3 or v.minor not in MINORS:
            continue
        if v.minor not in best or v > best[v.minor]:
            best[v.minor] = v
    return [best[m] for m in sorted(best)]


def parse_versions(text: str) -> list[Version]:
    """``"3.2.0,3.6.0"`` -> versions in the given order (repeats dropped); raises ValueError on a bad one."""
    out: list[Version] = []
    for s in filter(None, (x.strip() for x in text.split(","))):
        try:
            v = Version(s)
        except InvalidVersion:
            raise ValueError(f"not a version: {s!r}") from None
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError("no Triton version given")
    return out


def installed_triton() -> Version | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return Version(version("triton"))
    except PackageNotFoundError:
        return None


def venvs_root() -> Path:
    return cache_root() / "venvs"


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _child_triton(python: str) -> str:
    code = ("import importlib.metadata as m, filelock, platformdirs, packaging; "
            "print(m.version('triton'))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} cannot import what compiling needs: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip()


PIP_ATTEMPTS = 3


def _pip_install(python: Path, requirements: Sequence[str], what: str, log: Log = _quiet,
                 attempts: int = PIP_ATTEMPTS, run: Callable[..., Any] = subprocess.run,
                 pause: Callable[[float], None] = time.sleep) -> None:
    """``pip install`` into ``python``'s environment, tried up to ``attempts`` times.

    A download cut or altered on the way (pip then reports hashes that do not match, or a read timeout) fails
    one attempt, not the build: later attempts bypass pip's cache, so a bad file it kept is fetched again. The
    error, if every attempt fails, carries each attempt's last lines."""
    errors: list[str] = []
    for attempt in range(1, attempts + 1):
        cmd = [str(python), "-m", "pip", "install", "--quiet", *(["--no-cache-dir"] if attempt > 1 else []),
               *requirements]
        proc = run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode == 0:
            return
        tail = (proc.stderr or proc.stdout or "").strip()[-800:]
        errors.append(f"attempt {attempt}: {tail}")
        if attempt < attempts:
            log(f"pip could not install {what} (attempt {attempt} of {attempts}); trying again without its cache")
            pause(min(30.0, 5.0 * attempt))
    raise RuntimeError(f"pip could not install {what} in {attempts} attempts: " + " | ".join(errors))


def ensure_venv(version: Version, root: Path | None = None, log: Log = _quiet) -> str:
    """The interpreter of a virtual environment holding Triton ``version``; created on first use.

    ``<root>/triton-<version>``; a file lock keeps two runs from building one environment at once, and a
    marker written last tells a finished environment from a half-made one (which is removed and redone).
    """
    from filelock import FileLock

    root = venvs_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"triton-{version}"
    python = venv_python(venv)
    with FileLock(str(venv) + ".lock"):
        if (venv / READY).is_file() and python.exists():
            return str(python)
        if venv.exists():
            shutil.rmtree(venv)
        t0 = time.perf_counter()
        log(f"creating {venv} (Triton {version})")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        _pip_install(python, [f"triton=={version}", *VENV_PACKAGES], f"triton=={version} into {venv}", log)
        got = _child_triton(str(python))
        if Version(got) != version:
            raise RuntimeError(f"{venv} holds Triton {got}, not {version}")
        (venv / READY).write_text(f"triton=={version}\n")
        log(f"created {venv} in {time.perf_counter() - t0:.0f} s")
    return str(python)


# ----------------------------------------------------------------------------------------------------------
# Sampling


def gate_mode(unit_or_variant: Any) -> str:
    v = getattr(unit_or_variant, "variant", unit_or_variant)
    return "generic" if v.gate_bound is None else "bounded"


def _weight(u: BuildUnit) -> tuple[Any, ...]:
    v = u.variant
    # heaviest code paths first: largest head dim, varlen on, largest chunk, ieee fp32 dots
    return (v.K * v.V, v.K, v.varlen, v.chunk_size or 0, v.dot_precision == "ieee")


def sample_units(units: Sequence[BuildUnit], pairwise: bool = False) -> tuple[list[BuildUnit], list[BuildUnit]]:
    """One unit per family, (target, op, gate mode, dtype, gate dtype, varlen): the one at the largest head dim
    (then the largest chunk). The gate's dtype is a family of its own: a gate read in bf16 or fp16 is another
    load and conversion in every kernel that reads it. ``pairwise``: of the families that differ only in the
    gate's dtype, the one ``pairwise_gate`` names, where (target, op, dtype) has both gate modes (with one mode,
    two families could not cover the four pairs of varlen and gate dtype), so that fewer families still cover
    every pair of (gate mode, varlen, gate dtype) values within each (target, op, dtype). Returns ``(chosen,
    skipped)``, both in the input order."""
    best: dict[tuple[str, str, str, str, str, bool], BuildUnit] = {}
    for u in units:
        key = (u.target, u.variant.op, gate_mode(u), u.variant.dtype, u.variant.gate_dtype, u.variant.varlen)
        cur = best.get(key)
        # ties go to the first name in sort order, so the choice does not depend on the input order
        if cur is None or (_weight(u), _neg(u.name)) > (_weight(cur), _neg(cur.name)):
            best[key] = u
    if pairwise:
        # key without the gate dtype -> the gate dtypes built; (target, op, dtype) -> the gate modes built
        gates: dict[tuple[Any, ...], set[str]] = {}
        modes: dict[tuple[Any, ...], set[str]] = {}
        for key in best:
            gates.setdefault(key[:4] + key[5:], set()).add(key[4])
            modes.setdefault((key[0], key[1], key[3]), set()).add(key[2])
        best = {key: u for key, u in best.items()
                if len(gates[key[:4] + key[5:]]) == 1 or len(modes[key[0], key[1], key[3]]) == 1
                or key[4] == pairwise_gate(u)}
    chosen = {u.name for u in best.values()}
    return [u for u in units if u.name in chosen], [u for u in units if u.name not in chosen]


def pairwise_gate(u: BuildUnit) -> str:
    """The gate dtype the pairwise sample keeps for ``u``'s family where the gate may be read in the variant's
    own dtype or in fp32: its own for bounded dense and generic varlen families, fp32 for generic dense and
    bounded varlen ones. Every pair of values of two of (gate mode, varlen, gate dtype) then still meets (a
    covering array of strength 2) at about half the compiles: the oldest releases' sample that CI builds."""
    v = u.variant
    return v.dtype if (gate_mode(u) == "bounded") != v.varlen else "fp32"


def _neg(name: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in name)


# ----------------------------------------------------------------------------------------------------------
# Quirks in effect


def quirk_effects(spec: Any, target: str, version: Version, units: Sequence[BuildUnit]) -> dict[str, int]:
    """For each active, non-refusing registry entry: how many of ``units`` render differently without it
    (other flags or knobs). 0 means the template's defaults already avoid it."""
    arch = get_arch(target)
    pool = quirk_registry.load_quirks()
    out: dict[str, int] = {}
    for q in quirk_registry.active_quirks(arch.cc, version):
        if q.avoid.refuse or not any(q.matches_variant(u.variant.params()) for u in units):
            continue
        rest = [x for x in pool if x.id != q.id]
        changed = 0
        for u in units:
            # the unit as the build would make it without this entry (its flags then set as the build sets them,
            # e.g. the Gluon token pass's)
            try:
                alt = unit_for(spec, arch, version, u.variant, quirks=rest)
            except SpecError:  # a knob the unit takes only with this entry's caps
                changed += 1
                continue
            if not isinstance(alt, BuildUnit) or u.flags != alt.flags or u.tune != alt.tune:
                changed += 1
        out[q.id] = changed
    return out


# ----------------------------------------------------------------------------------------------------------
# Running


@dataclass
class Options:
    specs: list[Path]
    versions: list[Version]
    sample: bool = True
    pairwise: bool = False  # with sample: the pairwise sample (sample_units)
    jobs: int = 2
    targets: list[str] | None = None  # restrict to these targets (None: every target of each spec)
    ops: list[str] | None = None  # restrict to these ops
    dtypes: list[str] | None = None  # restrict to these dtypes
    kernel_cache: Path | None = None  # None: a temporary one, removed at the end
    venv_root: Path | None = None
    timeout: float = 900.0
    command: str = "dplr-gen compat"
    # a previous matrix's compat.json: a unit whose rendered source, target and release it records as built keeps
    # that result instead of being compiled again (a compile depends on nothing else; see reusable_units)
    reuse: Path | None = None
    # version string -> interpreter to use instead of making an environment (tests; the installed Triton)
    pythons: dict[str, str] = field(default_factory=dict)
    use_installed: bool = True  # the installed Triton compiles with this interpreter, no environment made


def _shown(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.name


def _git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=30).stdout
        except Exception:
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "dplr_gen", "specs").splitlines()
             if len(line) > 3]
    return {"commit": git("rev-parse", "--short=12", "HEAD").strip() or None, "uncommitted": sorted(dirty),
            **_inputs_state()}


def _inputs_state() -> dict[str, Any]:
    """Content hashes of what decides the compiled kernels besides the specs: the templates as rendered in this
    run (they may hold uncommitted work) and the quirk registry."""
    return {"templates": {f.name: source_hash(f.read_text()) for f in sorted(TEMPLATES_DIR.glob("*.jinja"))},
            "registry": source_hash(QUIRKS_FILE.read_text())}


# the note `dplr-gen compat` appends to the command it records when the releases were its defaults
RELEASES_NOTE = "  (default releases: "


def rerun_command(data: dict[str, Any]) -> str:
    """The command that regenerates the matrix ``data`` describes (its recorded command, without the note on
    default releases)."""
    return data.get("command", "dplr-gen compat --full").split(RELEASES_NOTE)[0]


def staleness(data: dict[str, Any], specs_dir: Path = SPECS_DIR) -> list[str]:
    """Why a compatibility matrix (the JSON of :func:`run`) no longer describes the tree: templates, quirk
    registry or spec files whose content differs from what it compiled, specs it does not cover, an unfinished
    run. Empty when it is current."""
    why: list[str] = []
    src = data.get("source") or {}
    now = _inputs_state()
    then = src.get("templates") or {}
    for name in sorted(set(now["templates"]) | set(then)):
        if name not in then:
            why.append(f"template {name} is not in the matrix")
        elif name not in now["templates"]:
            why.append(f"template {name} is in the matrix but no longer in {_shown(TEMPLATES_DIR)}")
        elif then[name] != now["templates"][name]:
            why.append(f"template {name} changed (matrix {then[name]}, tree {now['templates'][name]})")
    if src.get("registry") != now["registry"]:
        why.append(f"{_shown(QUIRKS_FILE)} changed (matrix {src.get('registry')}, tree {now['registry']})")
    recorded = {s["file"]: s.get("sha256_16") for s in data.get("specs", [])}
    for path in sorted(specs_dir.glob("*.yaml")):
        shown = _shown(path)
        if shown not in recorded:
            why.append(f"spec {shown} is not in the matrix")
        elif recorded[shown] != source_hash(path.read_text()):
            why.append(f"spec {shown} changed (matrix {recorded[shown]}, tree {source_hash(path.read_text())})")
    if not data.get("complete", True):
        why.append("the run that wrote it did not finish")
    return why


def _machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "node": platform.node(),
    }


def _short_error(text: str, n: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= n else line[: n - 3] + "..."


def run(opts: Options, log: Log = _quiet,
        checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Build every (spec, target, version) cell; returns the JSON-able result (see :func:`render_markdown`).

    Never raises for a failed compile, abort or environment: those become FAILED cells. ``checkpoint`` gets
    the partial result (``"complete": False``, unfinished cells ``pending``) after each compiled unit.
    """
    from ..toolchain import build as b
    from ..spec.models import load_spec

    t_start = time.perf_counter()
    installed = installed_triton()
    tmp_root = Path(tempfile.mkdtemp(prefix="dplr-gen-compat-"))
    kernel_cache = opts.kernel_cache or (tmp_root / "kernels")
    specs = [(p, load_spec(p)) for p in opts.specs]  # SpecError propagates: a usage error, before any work
    # what gets rendered: other people may edit templates and specs while this runs; note if they did
    source = _git_state()
    spec_hashes = {str(p): source_hash(p.read_text()) for p, _ in specs}

    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    work: list[tuple[tuple[str, str, str], BuildUnit, CompileJob]] = []
    prior = reusable_units(read_matrix(opts.reuse)) if opts.reuse else {}
    plans: dict[tuple[str, str], Any] = {}
    version_info: dict[str, dict[str, Any]] = {
        str(v): {"version": str(v), "python": None, "env": None, "env_seconds": 0.0, "error": None}
        for v in opts.versions
    }

    # 1. plan and render every (spec, version); decide each cell's units
    for path, spec in specs:
        targets = [t for t in spec.targets if opts.targets is None or t in opts.targets]
        for v in opts.versions:
            vs = str(v)
            out_root = tmp_root / "src" / f"triton-{vs}"
            try:
                p = b.plan(path, out_root=out_root, triton_version=v)
                b.write_package(p)
                plans[(spec.name, vs)] = p
            except Exception as e:  # a template that does not render for a release is a FAILED cell
                for t in targets:
                    cells[(spec.name, t, vs)] = _cell(spec.name, t, vs, status="failed",
                                                      error=f"planning failed: {type(e).__name__}: {e}")
                continue
            refused_by = {f.what: f.reason for f in p.refused}
            for t in targets:
                arch = get_arch(t)
                _, _, active, refusal = quirk_registry.arch_flags(arch.cc, v, arch.base_flags())
                cell = _cell(spec.name, t, vs, active=active)
                cells[(spec.name, t, vs)] = cell
                if refusal is not None:
                    cell.update(status="refused", refusal=refusal)
                    continue
                units = [u for u in p.units if u.target == t and (opts.ops is None or u.variant.op in opts.ops)
                         and (opts.dtypes is None or u.variant.dtype in opts.dtypes)]
                # units refused for this target by something else than the registry (e.g. a dtype the
                # arch lacks); variants the generator filters for every target are listed per spec
                cell["variants_refused"] = sorted(
                    [w.removesuffix(f"__{t}"), r] for w, r in refused_by.items() if w.endswith(f"__{t}")
                )
                chosen, skipped = sample_units(units, opts.pairwise) if opts.sample else (list(units), [])
                cell["variants_total"] = len(units)
                cell["variants_skipped"] = len(skipped)
                cell["variants_selected"] = len(chosen)
                cell["quirk_effects"] = quirk_effects(spec, t, v, chosen)
                for u in chosen:
                    rel = p.unit_files[u.name]
                    job = CompileJob(
                        unit=u.name, source=str(p.out_dir / rel), source_hash=source_hash(p.files[rel]),
                        target=u.target, cc=u.arch.cc, smem_limit=u.arch.smem_per_block,
                        check_mma=u.arch.mma != "v2", triton_version=vs, cache_root=str(kernel_cache),
                    )
                    kept = prior.get((spec.name, t, vs, u.name))
                    if kept is not None and kept["source_hash"] == job.source_hash:
                        cell["units"].append({**kept, "reused": True})
                        continue
                    work.append(((spec.name, t, vs), u, job))
                if not chosen:
                    cell.update(status="built" if not units else "failed",
                                error="" if not units else "no unit selected")

    # 2. an interpreter per version that has something to compile
    pythons: dict[str, str] = {}
    for v in opts.versions:
        vs = str(v)
        if not any(k[2] == vs for k, _, _ in work):
            continue
        info = version_info[vs]
        t0 = time.perf_counter()
        try:
            if vs in opts.pythons:
                py, kind = opts.pythons[vs], "given interpreter"
            elif opts.use_installed and installed is not None and installed == v:
                py, kind = sys.executable, "installed (this interpreter)"
            else:
                py, kind = ensure_venv(v, opts.venv_root, log), "own venv"
            info["env"] = kind
            got = _child_triton(py)
            if Version(got) != v:
                raise RuntimeError(f"{py} has Triton {got}, not {vs}")
            pythons[vs] = py
            info["python"] = py
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
            log(f"Triton {vs}: no environment: {info['error']}")
        info["env_seconds"] = round(time.perf_counter() - t0, 1)

    # 3. compile, heaviest op first so the parallel tail is short
    runnable = [w for w in work if w[0][2] in pythons]
    for key, u, job in work:
        if key[2] not in pythons:
            cells[key]["units"].append(_unit_record(
                u, CompileOutcome(u.name, u.target, False,
                                  error=f"no environment for Triton {key[2]}: {version_info[key[2]]['error']}"), 0.0,
                job.source_hash))
    runnable.sort(key=lambda w: (w[1].variant.op != "chunk", w[0][2], w[1].name))

    def one(item: tuple[tuple[str, str, str], BuildUnit, CompileJob]
            ) -> tuple[Any, BuildUnit, CompileJob, CompileOutcome, float]:
        key, u, job = item
        t0 = time.perf_counter()
        try:
            outcome = run_in_subprocess(job, timeout=opts.timeout, python=pythons[key[2]])
        except Exception as e:  # never let one unit end the run
            outcome = CompileOutcome(u.name, u.target, False, error=f"{type(e).__name__}: {e}")
        return key, u, job, outcome, time.perf_counter() - t0

    registry = {q.id: q for q in quirk_registry.load_quirks()}
    after = _git_state()
    changed = [k for k in sorted(set(source["templates"]) | set(after["templates"]))
               if source["templates"].get(k) != after["templates"].get(k)]
    changed += [p for p, h in spec_hashes.items() if source_hash(Path(p).read_text()) != h]
    if changed:
        source["changed_while_planning"] = changed
        log(f"warning: {', '.join(changed)} changed while the sources were being rendered; rerun for a "
            "consistent matrix")

    def assemble(complete: bool) -> dict[str, Any]:
        finished = {k: _finish_cell(cell) for k, cell in cells.items()}
        versions_out = []
        for v in opts.versions:
            vs = str(v)
            units = [r for c in finished.values() if c["triton"] == vs for r in c["units"]]
            kernels = [k for r in units for k in r.get("kernels", [])]
            versions_out.append({
                **version_info[vs],
                "units_compiled": len(units), "units_failed": sum(not r["ok"] for r in units),
                "units_reused": sum(bool(r.get("reused")) for r in units),
                "kernels": len(kernels), "unit_seconds": round(sum(r["seconds"] for r in units), 1),
                "kernel_compile_seconds": round(sum(k.get("compile_s") or 0.0 for k in kernels), 1),
                "slowest_kernel": max(
                    ({"unit": r["unit"], "kernel": k["kernel"], "compile_s": k["compile_s"]}
                     for r in units for k in r.get("kernels", [])), key=lambda x: x["compile_s"] or 0.0,
                    default=None),
            })
        used = sorted({q for c in finished.values() for q in c.get("active", [])})
        return {
            "schema": SCHEMA,
            "command": opts.command,
            "complete": complete,
            "generated_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": _machine(),
            "mode": ("pairwise sample" if opts.pairwise else "sample") if opts.sample else "full",
            "filters": {"targets": opts.targets, "ops": opts.ops, "dtypes": opts.dtypes},
            "reused_from": _shown(opts.reuse) if opts.reuse else None,
            "installed_triton": str(installed) if installed else None,
            "source": source,
            "wall_seconds": round(time.perf_counter() - t_start, 1),
            "timeout_s": opts.timeout,
            "versions": versions_out,
            "specs": [
                {"name": spec.name, "file": _shown(path), "sha256_16": spec_hashes[str(path)],
                 "targets": [t for t in spec.targets if opts.targets is None or t in opts.targets],
                 "filtered": [[f.what, f.reason] for f in expand(spec)[1]]}
                for path, spec in specs
            ],
            "cells": [finished[k] for k in sorted(finished, key=lambda k: (k[0], k[1], Version(k[2])))],
            "quirks": {
                qid: {"archs": list(registry[qid].archs), "triton": registry[qid].triton,
                      "pattern": registry[qid].pattern, "effect": registry[qid].effect,
                      "reference": registry[qid].reference,
                      "avoid": registry[qid].avoid.model_dump(exclude_defaults=True)}
                for qid in used if qid in registry
            },
        }

    done = 0
    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        futures = [pool.submit(one, w) for w in runnable]
        for fut in as_completed(futures):
            key, u, job, outcome, secs = fut.result()
            done += 1
            cells[key]["units"].append(_unit_record(u, outcome, secs, job.source_hash))
            state = "ok" if outcome.ok else "FAILED: " + _short_error(outcome.error, 200)
            log(f"[{done}/{len(runnable)}] Triton {key[2]} {u.name}: {state} ({secs:.1f} s)")
            if checkpoint is not None and done < len(runnable):
                checkpoint(assemble(complete=False))

    # 4. cell outcomes
    shutil.rmtree(tmp_root, ignore_errors=True)
    return assemble(complete=True)


def _finish_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``cell`` with its outcome decided from the unit results so far."""
    cell = {**cell, "units": sorted(cell["units"], key=lambda r: r["unit"])}
    if cell["status"] in ("refused", "failed") and not cell["units"]:
        return cell
    failed = [r for r in cell["units"] if not r["ok"]]
    cell["variants_compiled"] = len(cell["units"])
    cell["seconds"] = round(sum(r["seconds"] for r in cell["units"]), 1)
    if failed:
        cell["status"] = "failed"
        cell["error"] = f"{failed[0]['unit']}: {failed[0]['error']}"
    elif len(cell["units"]) < cell.get("variants_selected", 0):
        cell["status"] = "pending"
    else:
        cell["status"] = "built"
    cell["quirks_avoided"] = sorted(cell.get("quirk_effects", {}))
    return cell


def _cell(spec: str, target: str, version: str, status: str = "pending", error: str = "",
          active: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "spec": spec, "target": target, "triton": version, "status": status, "error": error, "refusal": "",
        "active": list(active), "quirk_effects": {}, "quirks_avoided": [], "variants_total": 0,
        "variants_compiled": 0, "variants_skipped": 0, "variants_refused": [], "seconds": 0.0, "units": [],
    }


def read_matrix(path: Path) -> dict[str, Any]:
    """A compat.json that `dplr-gen compat` wrote; ValueError naming the file where it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a compat.json that `dplr-gen compat` wrote ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise ValueError(f"{path}: not a compat.json that `dplr-gen compat` wrote (no list of cells)")
    return data


def reusable_units(data: dict[str, Any]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """(spec, target, release, unit) -> the unit's record, for every unit a matrix (compat.json) records as built
    with its rendered source's hash. Such a result holds for the same source, target and release (the compile
    and its checks read nothing else: the arch's limits come with the target); a failure is compiled again (a
    timeout need not repeat)."""
    return {(c["spec"], c["target"], c["triton"], r["unit"]): r for c in data.get("cells", [])
            for r in c.get("units", []) if r.get("ok") and r.get("source_hash")}


def _unit_record(u: BuildUnit, o: CompileOutcome, seconds: float, source_hash: str) -> dict[str, Any]:
    return {
        "unit": u.name, "variant": u.variant.name, "ok": o.ok, "error": o.error, "seconds": round(seconds, 1),
        "source_hash": source_hash,
        "flags": dict(u.flags), "tune": {st: k.model_dump() for st, k in u.tune.items()},
        "kernels": [
            {"kernel": k.get("kernel"), "shared": k.get("shared"), "num_warps": k.get("num_warps"),
             "num_stages": k.get("num_stages"), "compile_s": k.get("compile_s", 0.0)}
            for k in o.kernels
        ],
    }


# ----------------------------------------------------------------------------------------------------------
# Markdown


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def cell_text(cell: dict[str, Any]) -> str:
    """The table cell for one (spec, arch, Triton)."""
    status = cell["status"]
    if status == "refused":
        return f"refused: {_md(cell['refusal'])}"
    if status == "failed" and not cell["units"]:
        return f"**FAILED**: {_md(_short_error(cell['error']))}"
    n, total, skipped = cell["variants_compiled"], cell["variants_total"], cell["variants_skipped"]
    count = f"{n}/{total} compiled" + (f", {skipped} skipped by sampling" if skipped else "")
    if cell.get("variants_refused"):
        count += f", {len(cell['variants_refused'])} refused: " + "; ".join(
            sorted({_md(r) for _, r in cell["variants_refused"]}))
    if status == "pending":
        return f"not finished ({n} of {cell.get('variants_selected', '?')} selected compiled so far)"
    if status == "failed":
        bad = sum(not r["ok"] for r in cell["units"])
        return f"**FAILED** ({bad} of {n}; {count}): {_md(_short_error(cell['error']))}"
    effects = cell.get("quirk_effects", {})
    text = "built"
    if effects:
        ids = [q + ("" if effects[q] else "°") for q in sorted(effects)]
        text += ", quirks avoided: " + ", ".join(ids)
    return f"{text} ({count})"


def render_markdown(data: dict[str, Any]) -> str:
    """``docs/compat.md`` from the JSON result of :func:`run` (nothing else goes into it)."""
    versions = [v["version"] for v in data["versions"]]
    cells = {(c["spec"], c["target"], c["triton"]): c for c in data["cells"]}
    src = data.get("source", {})
    m = data["machine"]
    mode = (
        "sample: per (spec, arch, Triton) one variant per family (op, gate mode, dtype, gate dtype, varlen) is compiled, the "
        "one at the largest head dim (the heaviest code paths); the others are counted as skipped"
        if data["mode"] == "sample" else
        "pairwise sample: as the sample, but of the families that differ only in the gate's dtype, one: the variant's "
        "own gate dtype for bounded dense and generic varlen families, fp32 for the others"
        if data["mode"] == "pairwise sample" else "full: every variant is compiled"
    )
    lines = [
        "# Compatibility matrix: spec x arch x Triton",
        "",
        "<!-- Generated by dplr-gen compat from docs/compat.json. Do not edit: rerun the command. -->",
        "",
        *([] if data.get("complete", True) else [
            "**INCOMPLETE: the run is still going or was stopped; cells marked \"not finished\" have no outcome.**",
            ""]),
        f"Generated by `{data['command']}` on {data['generated_at']}, machine: {m['platform']}, "
        f"{m['cpus']} CPUs, Python {m['python']}, no GPU needed (ahead-of-time compiles). "
        f"Installed Triton: {data.get('installed_triton') or 'none'}. Wall time: {_dur(data['wall_seconds'])}.",
        "",
        f"Mode: **{data['mode']}** ({mode}). A unit that takes more than {data.get('timeout_s', 900):.0f} s to "
        "compile counts as FAILED."
        + (f" Units whose rendered source, target and release `{data['reused_from']}` records as built keep that "
           "result (counted as reused below; their times are those of their compile there)."
           if data.get("reused_from") else ""),
        "",
        f"Sources: commit `{src.get('commit') or '?'}`"
        + (f", with uncommitted changes in {', '.join(f'`{x}`' for x in src['uncommitted'])}" if src.get("uncommitted")
           else "")
        + (f"; templates rendered: {', '.join(f'`{k}` {v}' for k, v in sorted(src['templates'].items()))} "
           "(sha256, 16 digits)" if src.get("templates") else "") + ".",
        *([] if not src.get("changed_while_planning") else [
            "", f"**Warning: {', '.join(src['changed_while_planning'])} changed while the sources were rendered; "
            "some cells may reflect the old text.**"]),
    ]
    filt = data.get("filters") or {}
    if any(filt.values()):
        lines += ["", "Restricted to " + "; ".join(
            f"{k}: {', '.join(v)}" for k, v in filt.items() if v) + "."]
    lines += [
        "",
        "Each cell: **built** (every compiled variant passed the compile and the checks: shared memory within "
        "the arch's limit, and on wgmma/tcgen05 archs no conversion between two MMA layouts), **built, quirks "
        "avoided: ids** (rendered with the flags or knob caps of those registry entries; ° marks an entry whose "
        "workaround the template's defaults already satisfy, so it changed nothing), **refused: reason** (the "
        "registry says nothing avoids the failure there; nothing was attempted) or **FAILED: error** (a compile "
        "error, a failed check, an abort or a timeout). A build shows the compiler accepts the kernels; the "
        "registry's silent miscompiles are found only by a numeric test on that GPU.",
    ]
    for s in data["specs"]:
        lines += ["", f"## {s['name']} (`{s['file']}`" + (f", sha256 {s['sha256_16']}" if s.get("sha256_16") else "")
                  + ")", "",
                  "| arch | " + " | ".join(f"Triton {v}" for v in versions) + " |",
                  "|---|" + "---|" * len(versions)]
        for t in s["targets"]:
            row = [cell_text(cells[(s["name"], t, v)]) if (s["name"], t, v) in cells else "-" for v in versions]
            lines.append(f"| {t} | " + " | ".join(row) + " |")
        reasons: dict[str, int] = {}
        for _, r in s.get("filtered", []):
            reasons[r] = reasons.get(r, 0) + 1
        if reasons:
            lines += ["", "Combinations of the spec's axes the generator drops for every arch and release (not "
                      "counted above): " + "; ".join(f"{n} x \"{_md(r)}\"" for r, n in sorted(reasons.items())) + "."]

    failures = [c for c in data["cells"] if c["status"] == "failed"]
    if failures:
        lines += ["", "## Failures", ""]
        for c in failures:
            bad = [r for r in c["units"] if not r["ok"]] or [{"unit": "(cell)", "error": c["error"]}]
            for r in bad:
                flags = r.get("flags")
                tune = r.get("tune")
                detail = ""
                if flags is not None:
                    detail = (" flags: " + ", ".join(f"{k}={v}" for k, v in sorted(flags.items()))
                              + "; warps: " + ", ".join(f"{st}={k['num_warps']}" for st, k in sorted(tune.items())))
                lines += [f"- {c['spec']}, {c['target']}, Triton {c['triton']}: `{r['unit']}`{detail}", "",
                          "  ```", *("  " + x for x in r["error"].strip().splitlines()[:12]), "  ```"]

    if data["quirks"]:
        lines += ["", "## Registry entries in effect", "",
                  "From `dplr_gen/spec/data/quirks.yaml`, for the (arch, Triton) pairs above.", ""]
        for qid, q in sorted(data["quirks"].items()):
            avoid = q.get("avoid") or {}
            how = avoid.get("refuse") and f"refuse ({_md(avoid['refuse'])})" or ", ".join(
                f"{k}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(avoid.items())) or "nothing known"
            lines.append(
                f"- **{qid}** (sm {', '.join(map(str, q['archs']))}; Triton {q['triton']}; {q['effect']}): "
                f"{_md(q['pattern'])}. Avoided by: {how}. Reference: {_md(q['reference'])}"
            )

    refusals = sorted({c["refusal"] for c in data["cells"] if c["status"] == "refused"})
    if refusals:
        lines += ["", "## Refusals", ""]
        for r in refusals:
            where = sorted({f"{c['target']} x {c['triton']}" for c in data["cells"] if c["refusal"] == r},
                           key=lambda s: (s.split(" x ")[0], Version(s.split(" x ")[1])))
            lines.append(f"- {_md(r)}: {', '.join(where)}")

    lines += ["", "## Timings", "",
              "| Triton | environment | units compiled | failed | kernels passed | unit wall time (sum) | "
              "kernel compile time (sum, passed kernels) | slowest passed kernel | slowest unit |",
              "|---|---|---|---|---|---|---|---|---|"]
    for v in data["versions"]:
        slow = v.get("slowest_kernel")
        slow_s = f"{slow['kernel']} in {slow['unit']}: {slow['compile_s']:.1f} s" if slow else "-"
        units = [r for c in data["cells"] if c["triton"] == v["version"] for r in c["units"]]
        su = max(units, key=lambda r: r["seconds"], default=None)
        slow_s += " | " + (f"{su['unit']}: {_dur(su['seconds'])} ({'ok' if su['ok'] else 'FAILED'})" if su else "-")
        env = "error: " + _md(_short_error(v["error"], 80)) if v.get("error") else (v.get("env") or "not needed")
        lines.append(
            f"| {v['version']} | {env} | {v['units_compiled']}"
            + (f" ({v['units_reused']} reused)" if v.get("units_reused") else "")
            + f" | {v['units_failed']} | {v['kernels']} | "
            f"{_dur(v['unit_seconds'])} | {_dur(v['kernel_compile_seconds'])} | {slow_s} |"
        )
    lines += ["", "Unit wall time: one subprocess per unit (`--jobs` in parallel), Python start and Triton import "
              "included; a unit stops at its first failing kernel. Kernel compile times are Triton's, for kernels "
              "that passed (a kernel found in a reused `--kernel-cache` counts its first compile). Per-unit and "
              "per-kernel times are in `docs/compat.json`.", ""]
    return "\n".join(lines)


def _dur(s: float) -> str:
    s = float(s)
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def write_outputs(data: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    from ..toolchain.cache import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    j, md = out_dir / "compat.json", out_dir / "compat.md"
    atomic_write_text(j, json.dumps(data, indent=1, sort_keys=True) + "\n")
    atomic_write_text(md, render_markdown(data))
    for f in (j, md):
        f.chmod(0o644)
    return j, md


def any_failed(data: dict[str, Any]) -> bool:
    return any(c["status"] == "failed" for c in data["cells"])

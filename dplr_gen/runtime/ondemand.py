"""Variants generated on demand, for calls that no built variant of a package covers.

Such a call gets its variant rendered from the package's own spec: the same templates, the target's arch profile,
the spec's tuning rules (tuning, target_tuning, variant_tuning) and the quirk registry, exactly as `dplr-gen build`
would render it had the spec listed it. On a GPU its kernels are compiled for this GPU's target into the
content-addressed cache, in as many subprocesses at once as there are CPUs (each a group of the kernels), then
loaded as prebuilt kernels are; under the interpreter the rendered file runs as is (nothing to compile). The rendered source is a real .py file
in the cache (Triton needs one), written atomically; the kernels are keyed by that source's hash, so a later
process (or a build of a spec that lists the variant) finds them and compiles nothing. A record written last
under the variant's lock says which source and entries make the variant: two processes generating it at once
compile it once. A kernel over the target's shared memory is compiled again with smaller tiles (block_v halved,
then fewer pipeline stages) until it fits.

Each variant so served is named once per process, with the spec entry that would ship it ahead of time, in an
OnDemandVariantWarning (seen without configuring anything; silenced by its category) and a record on the "dplr_gen"
logger at INFO. DPLR_GEN_NO_JIT=1 (production) refuses instead, naming that entry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..toolchain import cache, settings
from ..toolchain.compile import import_source, job_for, run_in_subprocess
from .loader import NO_JIT_ENV, KernelSet, env_flag, interpreted_kernel_set, interpreting, keeps_stubs, \
    load_cached_kernels
from ..plan.variant import Variant

if TYPE_CHECKING:
    from .loader import SpecPackage
    from ..spec.models import Spec
    from ..plan.variants import BuildUnit

LOG = logging.getLogger("dplr_gen")
# what this process did for on-demand variants (tests and scripts/jit_first_call.py read it)
STATS: Counter[str] = Counter()
# compiles of one variant that may follow a shared-memory refusal, each with smaller tiles
MAX_SHRINKS = 8
# how many compile subprocesses an on-demand variant uses at once (unset or 0: one per CPU)
JOBS_ENV = "DPLR_GEN_JIT_JOBS"


class OnDemandVariantWarning(UserWarning):
    """A call ran a variant its package does not ship: generated at run time (rendered and, on a GPU, compiled for
    seconds). Said once per variant per process, naming the spec entry that ships it ahead of time; silence it with
    ``warnings.filterwarnings("ignore", category=OnDemandVariantWarning)``."""


_ANNOUNCED: set[str] = set()  # variants this process has warned about


# ----------------------------------------------------------------------------------------------------------
# which variant a call gets


def choose(package: "SpecPackage", op: str, dtype: str, K: int, V: int, varlen: bool,
           lower_bound: float | None, gate_dtype: str | None) -> Variant:
    """The variant generated for a call the package's built variants do not cover: the call's op, dtype, K, V and
    varlen; the chunk size (and fp32 dot precision) most of the package's variants of that op and dtype use; the
    largest gate bound of the package at or below ``lower_bound`` (else any gate); gk read in the inputs' dtype
    where it arrives so and the package builds such variants, else in fp32 (which takes gk of any dtype)."""
    from ..plan.variants import filtered_reason

    same_op = [v for v in package.variants.values() if v.op == op]
    like = [v for v in same_op if v.dtype == dtype] or same_op
    chunk = None
    if op == "chunk":
        sizes = Counter(v.chunk_size for v in like)
        chunk = min(sizes, key=lambda c: (-sizes[c], c)) if sizes else 16
    dot = None
    if dtype == "fp32":
        precisions = Counter(v.dot_precision for v in like if v.dot_precision)
        dot = "ieee" if not precisions or "ieee" in precisions else precisions.most_common(1)[0][0]
    bound = None
    if op == "chunk" and lower_bound is not None:
        fits = [v.gate_bound for v in same_op if v.gate_bound is not None and v.gate_bound <= lower_bound]
        bound = max(fits, default=None)
    gate = "fp32"
    if gate_dtype == dtype and any(v.gate_dtype == dtype for v in same_op if v.dtype == dtype):
        gate = dtype
    v = Variant(op=op, dtype=dtype, gate_dtype=gate, K=K, V=V, chunk_size=chunk, varlen=varlen, gate_bound=bound,
                state_dtype="fp32", dot_precision=dot)
    if filtered_reason(v) is not None and op == "chunk":  # e.g. fp32 ieee at chunk 64: the 16-token chunks
        v = dataclasses.replace(v, chunk_size=16)
    return v


def describe(op: str, dtype: str, K: int, V: int, varlen: bool, gate_dtype: str | None,
             lower_bound: float | None) -> str:
    """A request in words, as the errors name it."""
    return (f"{op} {dtype} K={K} V={V} {'varlen' if varlen else 'dense'}"
            + ("" if gate_dtype is None else f" gk {gate_dtype}")
            + ("" if lower_bound is None else f" with gates >= {lower_bound}"))


def provide(package: "SpecPackage", op: str, dtype: str, K: int, V: int, varlen: bool,
            lower_bound: float | None, gate_dtype: str | None) -> str:
    """The name of the variant generated for this request, selectable in ``package`` from now on (rendered and
    compiled when its kernels are first loaded); a ValueError naming the spec entry where DPLR_GEN_NO_JIT=1."""
    v = choose(package, op, dtype, K, V, varlen, lower_bound, gate_dtype)
    if env_flag(NO_JIT_ENV, False):
        raise ValueError(not_built_message(package, v, describe(op, dtype, K, V, varlen, gate_dtype, lower_bound)))
    return package.add_variant(v, kernel_set)


def spec_entry(v: Variant) -> str:
    """The variant group (one YAML line) that ships ``v`` ahead of time in a spec's ``variants``."""
    parts = [f"ops: [{v.op}]", f"dtypes: [{v.dtype}]",
             f"head_dims: [{v.K if v.K == v.V else f'[{v.K}, {v.V}]'}]"]
    if v.chunk_size is not None:
        parts.append(f"chunk_sizes: [{v.chunk_size}]")
    parts.append(f"varlen: [{str(v.varlen).lower()}]")
    if v.op == "chunk":
        parts.append(f"gate_bounds: [{'null' if v.gate_bound is None else repr(v.gate_bound)}]")
    if v.gate_dtype != "fp32":
        parts.append("gate_dtype: same")
    if v.dot_precision not in (None, "ieee"):
        parts.append(f"dot_precisions: [{v.dot_precision}]")
    return "- {" + ", ".join(parts) + "}"


def not_built_message(package: "SpecPackage", v: Variant, wanted: str, nearest: int = 4) -> str:
    """The DPLR_GEN_NO_JIT=1 refusal: what was asked, the spec entry that would ship it, the nearest few built
    variants, and how to list them all."""

    def distance(b: Variant) -> tuple[Any, ...]:
        return (b.op != v.op, b.dtype != v.dtype, abs(b.K - v.K) + abs(b.V - v.V), b.varlen != v.varlen,
                b.gate_bound != v.gate_bound, b.gate_dtype != v.gate_dtype, b.name)

    built = sorted((b for n, b in package.variants.items() if package.built(n)), key=distance)
    near = ", ".join(b.name for b in built[:nearest]) or "none"
    return (
        f"no built variant of spec {package.name!r} ({package.spec_file}) computes {wanted}, and {NO_JIT_ENV}=1 "
        f"forbids generating one at run time. To ship it, add to the variants of {package.spec_file}:  "
        f"{spec_entry(v)}  and run `dplr-gen build {package.spec_file}` (or unset {NO_JIT_ENV} to generate it on "
        f"first use). Nearest built: {near} (all {len(built)}: `dplr-gen list {package.spec_file}`)"
    )


# ----------------------------------------------------------------------------------------------------------
# render, compile, cache


@dataclasses.dataclass
class Prepared:
    """A variant's rendered source for one target and, when compiled, its kernels' cache entries."""

    unit: str
    source: Path
    kernels: list[tuple[str, str]]  # (kernel, cache key); empty where not compiled (the interpreter)
    compiled: int = 0  # kernels this call compiled (0: all found in the cache)
    seconds: float = 0.0
    shrunk: list[str] = dataclasses.field(default_factory=list)  # knob changes that made it fit
    needs_allocator: bool = False  # its kernels may need global scratch (runtime._set_torch_allocator)


def _triton_version() -> str:
    from ..toolchain.build import installed_triton

    return str(installed_triton())


def ondemand_dir(spec_name: str, root: Path | None = None) -> Path:
    """Where the on-demand sources and records of a spec live in the cache (beside the kernel entries)."""
    return (root or cache.cache_root()) / f"triton-{_triton_version()}" / "ondemand" / spec_name


def unit_of(spec: "Spec", v: Variant, target: str) -> "BuildUnit":
    """Variant ``v`` of ``spec`` for ``target``, as the build would make it (knobs the variant cannot take
    dropped); a ValueError where the target refuses it."""
    from ..spec.arch import get_arch
    from ..toolchain.build import installed_triton
    from ..plan.variants import BuildUnit, unit_for

    u = unit_for(spec, get_arch(target), installed_triton(), v, lenient=True)
    if not isinstance(u, BuildUnit):
        raise ValueError(f"variant {v.name} cannot be generated for {target}: {u.reason}")
    return u


def _write_source(u: "BuildUnit", d: Path) -> tuple[Path, str]:
    from ..render.render import render_unit, source_hash

    text = render_unit(u)
    path = d / f"{u.name}-{source_hash(text)}.py"
    if not path.is_file():  # content-addressed: an existing file holds this text
        cache.atomic_write_text(path, text)
    return path, text


def prepare(spec: "Spec", v: Variant, target: str, compile: bool = True, root: Path | None = None,
            jobs: int | None = None) -> Prepared:
    """Render ``v`` for ``target`` into the cache and, with ``compile``, make sure its kernels are there
    (compiled in parallel subprocesses, ``jobs`` at once, unless a record shows them cached)."""
    root = root or cache.cache_root()
    d = ondemand_dir(spec.name, root)
    u = unit_of(spec, v, target)
    source, text = _write_source(u, d)
    alloc = bool(u.flags.get("needs_allocator"))
    if not compile:
        return Prepared(u.name, source, [], needs_allocator=alloc)
    from ..render.render import source_hash

    record = d / f"{u.name}-{source_hash(text)}.json"
    tv = _triton_version()
    with cache.locked(cache.cache_key(ondemand=str(record)), tv, root):
        found = _read_record(record, root, tv)
        if found is not None:
            STATS["from_cache"] += 1
            found.needs_allocator = alloc
            return found
        t0 = time.perf_counter()
        prepared = _compile(u, source, text, root, tv, jobs)
        prepared.seconds = time.perf_counter() - t0
        prepared.needs_allocator = alloc
        cache.atomic_write_text(record, json.dumps({
            "unit": prepared.unit, "source": prepared.source.name, "kernels": prepared.kernels,
            "shrunk": prepared.shrunk}, indent=1) + "\n")
    return prepared


def _read_record(record: Path, root: Path, tv: str) -> Prepared | None:
    """The record's variant where its source and every kernel entry are in the cache, else None."""
    try:
        rec = json.loads(record.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    source = record.parent / rec["source"]
    kernels = [(name, key) for name, key in rec["kernels"]]
    if not source.is_file() or any(cache.read_entry(key, tv, root) is None for _, key in kernels):
        return None
    return Prepared(rec["unit"], source, kernels, shrunk=rec.get("shrunk", []))


# relative compile cost of a chunk unit's kernels (Triton 3.6, sm_80 / sm_90): the backward's two big kernels take
# 2-4x the others; used to spread the kernels over the compile processes
HEAVY_KERNELS = {"chunk_dplr_bwd_kernel": 3.0, "chunk_dplr_prep_bwd_kernel": 3.0}


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def spread(names: list[str], groups: int) -> list[list[str]]:
    """``names`` in at most ``groups`` groups of about equal compile cost (heaviest first, each to the lightest
    group): one compile process per group. One process per kernel pays Triton's import and start-up each time
    (2 cores: 12.6-16.5 s for a 14-kernel unit against 7.2-8.6 s in one process), so there are no more groups
    than CPUs."""
    bins: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(max(1, min(groups, len(names))))]
    for n in sorted(names, key=lambda n: -HEAVY_KERNELS.get(n, 1.0)):
        i = min(range(len(bins)), key=lambda j: bins[j][0])
        bins[i] = (bins[i][0] + HEAVY_KERNELS.get(n, 1.0), bins[i][1] + [n])
    return [b for _, b in bins if b]


def compile_processes(jobs: int | None) -> int:
    """How many compile processes an on-demand variant uses: ``jobs``, else JOBS_ENV (a SettingError where it is
    not a whole number), else one per CPU."""
    return jobs or settings.count(JOBS_ENV) or cpus()


def _compile(u: "BuildUnit", source: Path, text: str, root: Path, tv: str, jobs: int | None) -> Prepared:
    """Compile every kernel of the unit in ``jobs`` (default: one per CPU) subprocesses at once, each a share of
    the kernels; a kernel over the shared memory limit has its stage's tiles shrunk and the unit is rendered
    and compiled again."""
    shrunk: list[str] = []
    compiled = 0
    for _ in range(MAX_SHRINKS + 1):
        module = import_source(source, f"dplr_gen_ondemand_{source.stem}")
        groups = spread(list(module.SIGNATURES), compile_processes(jobs))
        job_list = [job_for(u, source, text, root, tv, kernels=g) for g in groups]
        with ThreadPoolExecutor(len(job_list)) as pool:
            outcomes = list(pool.map(run_in_subprocess, job_list))
        STATS["compile_jobs"] += len(job_list)
        compiled += sum(len(o.compiled) for o in outcomes)
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            STATS["compiled_kernels"] += compiled
            kernels = [(k["kernel"], k["key"]) for o in outcomes for k in o.kernels]
            return Prepared(u.name, source, kernels, compiled, shrunk=shrunk)
        over = [k for o in failed for k in o.over_smem]
        if any(not o.failed or set(o.failed) != set(o.over_smem) for o in failed):
            raise RuntimeError(f"generating variant {u.variant.name} on demand for {u.target} failed: "
                               + "; ".join(o.error for o in failed))
        smaller = _shrink(u, module, over)
        if smaller is None:
            raise RuntimeError(f"generating variant {u.variant.name} on demand for {u.target}: "
                               + "; ".join(o.error for o in failed) + " (and no smaller tiles are left to try)")
        u, change = smaller
        shrunk.append(change)
        source, text = _write_source(u, source.parent)
    raise RuntimeError(f"generating variant {u.variant.name} on demand for {u.target}: still over the shared "
                       f"memory limit after {MAX_SHRINKS} smaller tilings ({'; '.join(shrunk)})")


def stage_of(op: str, kernel: str) -> str:
    """The tuning stage whose knobs a rendered kernel takes (templates' LAUNCH tables)."""
    if op == "fused_recurrent":
        return "step" if "_step" in kernel else "fwd"
    name = kernel.removeprefix("chunk_dplr_").removesuffix("_kernel")
    small = "_small" in name or "seg" in name
    if name.startswith("prep"):
        return "prep"
    if name.startswith("bwd_dh") or name == "seg_maps_bwd":
        return "bwd_dh_small" if small else "bwd_dh"
    if name.startswith("fwd") or name == "seg_maps":
        return "fwd_small" if small else "fwd"
    return "bwd"


def _shrink(u: "BuildUnit", module: Any, kernels: list[str]) -> tuple["BuildUnit", str] | None:
    """``u`` with smaller tiles for the stages of ``kernels`` (over the shared memory limit): the V tile halved
    while wider than 16, else one pipeline stage fewer; None where neither is left, or changes the source."""
    from ..render.render import render_unit

    before = render_unit(u)
    for knob in ("block_v", "num_stages"):
        tune = dict(u.tune)
        changes = []
        for name in kernels:
            stage = stage_of(u.variant.op, name)
            knobs = tune[stage]
            bv = module.CONSTEXPRS[name].get("BV")
            if knob == "block_v" and bv and bv > 16:
                tune[stage] = knobs.model_copy(update={"block_v": bv // 2})
                changes.append(f"{u.variant.op}.{stage}.block_v {bv} -> {bv // 2}")
            elif knob == "num_stages" and knobs.num_stages and knobs.num_stages > 1:
                tune[stage] = knobs.model_copy(update={"num_stages": knobs.num_stages - 1})
                changes.append(f"{u.variant.op}.{stage}.num_stages {knobs.num_stages} -> {knobs.num_stages - 1}")
        if changes:
            candidate = dataclasses.replace(u, tune=tune)
            if render_unit(candidate) != before:
                return candidate, ", ".join(changes)
    return None


# ----------------------------------------------------------------------------------------------------------
# the run-time side


@functools.cache
def spec_of(package_dir: str, spec_file: str, name: str) -> "Spec":
    """The spec a package was built from: its spec_file under the repository, or beside the package folder."""
    from ..toolchain.build import REPO_ROOT
    from ..spec.models import load_spec

    d = Path(package_dir)
    for candidate in (REPO_ROOT / spec_file, d.parent / spec_file, d.parent / Path(spec_file).name):
        if candidate.is_file():
            spec = load_spec(candidate)
            if spec.name == name:
                return spec
    raise FileNotFoundError(f"cannot generate a variant of spec {name!r} on demand: its spec file {spec_file} "
                            f"was not found (looked under {REPO_ROOT} and {d.parent})")


def kernel_set(package: "SpecPackage", v: Variant, target: str) -> KernelSet:
    """The kernels of on-demand variant ``v`` for ``target`` (rendered and compiled where not in the cache)."""
    spec = spec_of(package.dir_str, package.spec_file, package.name)
    interp = interpreting()
    prepared = prepare(spec, v, target, compile=not interp)
    module = import_source(prepared.source, f"dplr_gen_kernels.{package.name}.ondemand.{prepared.source.stem}")
    entry = spec_entry(v)
    where = f"add to the variants of {package.spec_file}:  {entry}"
    if interp:
        STATS["rendered"] += 1
        _announce(v, f"dplr-gen: variant {v.name} rendered on demand for the interpreter ({prepared.source}); to ship "
                     f"it ahead of time, {where}")
        return interpreted_kernel_set(module)
    from ..toolchain import launch_stubs
    from .loader import _set_torch_allocator

    if prepared.needs_allocator:
        _set_torch_allocator()
    root = cache.cache_root()
    aot, why = load_cached_kernels(module, prepared.kernels, root)
    if aot is None:  # removed from under us since prepare: a clear error, not a JIT compile
        raise RuntimeError(f"on-demand variant {v.name} for {target}: {why}")
    launch_stubs.warm_launchers(aot.values(), keep_in=(root, _triton_version()) if keeps_stubs() else None)
    fit = f"; tiles made smaller to fit shared memory: {'; '.join(prepared.shrunk)}" if prepared.shrunk else ""
    if prepared.compiled:
        _announce(v, f"dplr-gen: generated variant {v.name} for {target} on demand ({prepared.compiled} kernels "
                     f"compiled in {prepared.seconds:.1f} s, kept in {prepared.source.parent}{fit}); to ship it ahead "
                     f"of time, {where}")
    else:
        _announce(v, f"dplr-gen: variant {v.name} for {target} loaded from the on-demand cache "
                     f"({prepared.source.parent}{fit}); to ship it ahead of time, {where}")
    return KernelSet(module, aot)


def _announce(v: Variant, message: str) -> None:
    """Say that ``v`` runs generated on demand: a warning the first time in this process (a record on the logger
    at INFO alone is not seen unless logging is configured), and a log record each time it is loaded."""
    LOG.info("%s", message)
    if v.name not in _ANNOUNCED:
        _ANNOUNCED.add(v.name)
        warnings.warn(message, OnDemandVariantWarning, stacklevel=3)

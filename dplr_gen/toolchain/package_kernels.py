"""A built package's compiled kernels, read from its folder (generated/<spec>/: index.json, manifest.json) and
dplr-gen's cache, without the runtime: the build keeps their launch stubs with them (build_launch_stubs) and the
runtime's loader loads them through the same functions. Here, in the toolchain layer, so that the build never
imports the runtime above it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from . import cache, settings
from .compile import import_source

KEEP_STUBS_ENV = "DPLR_GEN_KEEP_STUBS"  # "0": launch stubs stay in Triton's cache only


def keeps_stubs() -> bool:
    """Whether launch stubs are kept in (and looked up in) dplr-gen's cache (KEEP_STUBS_ENV, on by default;
    "0" or empty turns it off; another value is an error naming the setting)."""
    return settings.flag(KEEP_STUBS_ENV, True)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The package's manifest.json (written last by a build), or None where it has none (or a torn one)."""
    try:
        return json.loads((Path(directory) / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def unit_module(directory: Path, spec_name: str, target_entry: dict[str, Any]) -> Any:
    """The rendered module of one (variant, target) entry of a package's index (one module name per unit, so
    the build and the loader share it in a process)."""
    unit = target_entry["unit"]
    return import_source(Path(directory) / target_entry["source"], f"dplr_gen_kernels.{spec_name}.{unit}")


def not_built(manifest: dict[str, Any] | None, unit: str | None) -> str:
    """Why ``manifest`` (a package's) names no compiled kernels of ``unit`` for this process's Triton release;
    "" where it does."""
    from . import triton_versions

    if manifest is None:
        return "the package has not been built on this machine (no manifest.json)"
    installed = str(triton_versions.triton_version())
    if manifest["triton_version"] != installed:
        return f"it was built with Triton {manifest['triton_version']}, this process has {installed}"
    if unit not in manifest["units"]:
        return "the last build did not produce it"
    # a manifest outlives its kernels where the cache was cleaned: "built" only while every entry is there
    root = cache_root_of(manifest)
    gone = [k["kernel"] for k in manifest["units"][unit].get("kernels", [])
            if not cache.present(k["key"], installed, root)]
    if gone:
        return f"its kernels {', '.join(gone)} are gone from the cache {root} (`dplr-gen build` compiles them again)"
    return ""


def cache_root_of(manifest: dict[str, Any]) -> Path:
    """The cache the build that wrote ``manifest`` compiled into."""
    return Path(manifest.get("cache_root") or cache.cache_root())


def stub_store(manifest: dict[str, Any] | None) -> tuple[Path, str] | None:
    """Where launch stubs are kept beside a package's kernels (see launch_stubs.driver_modules_kept_in)."""
    if manifest is None or not keeps_stubs():
        return None
    return cache_root_of(manifest), manifest["triton_version"]


def load_cached_kernels(module: Any, records: list[tuple[str, str]], root: Path) -> tuple[dict[str, Any] | None, str]:
    """The kernels (name, cache key) of ``records`` from dplr-gen's cache under ``root`` for this process's Triton
    release, launchable without compiling; or None and why not."""
    return _cached_kernels(records, root, lambda name, meta: (
        getattr(module, name), module.SIGNATURES[name], module.CONSTEXPRS[name]))


def _cached_kernels(records: list[tuple[str, str]], root: Path, parts: Callable[[str, dict[str, Any]], Any],
                    ) -> tuple[dict[str, Any] | None, str]:
    """``load_cached_kernels`` with each kernel's (function, signature, constexprs) from ``parts(name, entry
    metadata)``."""
    from . import launch, triton_versions

    installed = str(triton_versions.triton_version())
    out: dict[str, Any] = {}
    for name, key in records:
        meta = cache.read_entry(key, installed, root)
        if meta is None:
            return None, f"its cache entry for {name} is missing under {root}"
        fn, signature, constexprs = parts(name, meta)
        # the integers the kernel was compiled to assume divisible by 16 (a source's DIVISIBLE table)
        divisible = meta["triton_metadata"].get("divisible_args", ())
        out[name] = launch.load_kernel(fn, signature, constexprs, cache.entry_dir(key, installed, root),
                                       meta["triton_metadata"].get("hash", key), divisible_args=divisible)
    return out, ""


def aot_kernels(module: Any, unit: str, manifest: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """A unit's kernels from the cache entries ``manifest`` (its package's) names, or None and why not."""
    why = not_built(manifest, unit)
    if why:
        return None, why
    assert manifest is not None  # not_built says why otherwise
    return load_cached_kernels(module, _kernel_records(manifest["units"][unit]), cache_root_of(manifest))


def _kernel_records(unit_record: dict[str, Any]) -> list[tuple[str, str]]:
    """(kernel name, cache key) of each kernel a manifest's unit record names."""
    return [(k["kernel"], k["key"]) for k in unit_record["kernels"]]


class _NoRecord(Exception):
    pass


def _declared_records(unit_record: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(kernel name, cache key) of every kernel the unit's source declares, where the build recorded them all;
    None where it recorded less (a build by an earlier dplr-gen, or of some of the unit's kernels only)."""
    records = _kernel_records(unit_record)
    if "declared" not in unit_record or {n for n, _ in records} != set(unit_record["declared"]):
        return None
    return records


def recorded_kernels(unit: str, manifest: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """A built unit's launch tables (``launch.LaunchTables``) and kernels from its manifest record and the launch
    records in its kernels' cache entries, without importing its rendered source; None where the build
    recorded less (a build by an earlier dplr-gen, or of some of the unit's kernels only). The caller checked
    that ``manifest`` has the unit built for this Triton release (``not_built``)."""
    from . import launch

    rec = manifest["units"][unit]
    records = _declared_records(rec)
    if records is None:
        return None
    tables = launch.LaunchTables(rec.get("options", {}))

    def parts(name: str, meta: dict[str, Any]) -> Any:
        if "launch" not in meta:
            raise _NoRecord
        fn = launch.RecordedKernel(meta["launch"])
        tables.add(name, fn)
        return fn, fn.signature, fn.constants

    try:
        kernels, _ = _cached_kernels(records, cache_root_of(manifest), parts)
    except _NoRecord:
        return None
    return (tables, kernels) if kernels is not None else None


def direct_kernels(unit: str, manifest: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """A built unit's launch tables and kernels launched from the direct records this machine keeps of them
    (``launch_direct``: no Triton import, its launch stubs called directly); None where a kernel has no record
    here (the first process on a machine loads through Triton and keeps them) or stubs are not kept. The caller
    checked that ``manifest`` has the unit built for this Triton release (``not_built``)."""
    from . import launch, launch_direct

    store = stub_store(manifest)
    rec = manifest["units"][unit]
    records = _declared_records(rec)
    if store is None or records is None or launch_direct.hooks_set():
        return None
    root, version = store
    tables = launch.LaunchTables(rec.get("options", {}))
    kernels: dict[str, Any] = {}
    for name, key in records:
        meta = cache.read_entry(key, version, root)
        k = None if meta is None or "launch" not in meta else launch_direct.load(
            key, cache.entry_dir(key, version, root), root, version)
        if k is None:
            return None
        tables.add(name, launch.RecordedKernel(meta["launch"]))
        kernels[name] = k
    return tables, kernels


def keep_direct_records(unit: str, manifest: dict[str, Any], kernels: dict[str, Any]) -> int:
    """Keep on this machine the direct records of a built unit's ``kernels`` (name -> kernel loaded through
    Triton; their binaries get loaded on the current GPU), so that later processes launch them without Triton
    (``direct_kernels``); the number kept. Nothing where stubs are not kept."""
    from . import launch_direct

    store = stub_store(manifest)
    if store is None:
        return 0
    by_key = {key: kernels[name] for name, key in _kernel_records(manifest["units"][unit]) if name in kernels}
    return launch_direct.keep(by_key, *store)


def build_launch_stubs(directory: Path) -> int:
    """Build (or find) the launch stubs of every kernel the package's manifest names and keep them in dplr-gen's
    cache, so that a fresh process on this machine, even with an empty Triton cache, compiles none. Needs
    Triton's CUDA driver (a GPU); returns the number of kernels covered. A FileNotFoundError where the package
    has no manifest (not built)."""
    from . import launch_stubs

    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise FileNotFoundError(f"{directory} has no manifest.json: build its spec first")
    index = json.loads((directory / "index.json").read_text())
    kernels: list[Any] = []
    units: list[tuple[str, dict[str, Any]]] = []
    for entry in index["variants"].values():
        for t in entry["targets"].values():
            if t["unit"] not in manifest["units"]:
                continue
            aot, _ = aot_kernels(unit_module(directory, index["spec"], t), t["unit"], manifest)
            if aot:
                units.append((t["unit"], aot))
                kernels.extend(aot.values())
    launch_stubs.warm_launchers(kernels, keep_in=stub_store(manifest))
    for unit, aot in units:
        keep_direct_records(unit, manifest, aot)
    return len(kernels)

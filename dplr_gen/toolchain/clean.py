"""Which cache entries the built packages use, and removing those no package uses any more.

Kernels are stored by content, so specs share them: a copy of specs/ada.yaml under another name finds every kernel
of ada's build in the cache. A package's manifest.json names the entries it loads. Cleaning one spec removes its
manifest and only the entries that no other package's manifest (nor an on-demand record) names. The packages are
those under generated/ and every other one a build recorded in the cache's registry (``<root>/packages/``: another
checkout, a test's or a script's out_root sharing the cache).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from . import cache

REGISTRY = "packages"  # under the cache root: one file per manifest a build wrote, naming it
ONDEMAND = "ondemand"  # under triton-<version>/: records of variants generated at run time (runtime/ondemand.py)

Entry = tuple[str, str]  # (Triton version, cache key)


def manifest_root(manifest: dict[str, Any]) -> Path:
    """The cache a manifest's kernels were stored in."""
    return Path(manifest.get("cache_root") or cache.cache_root())


def manifest_entries(manifest: dict[str, Any]) -> set[Entry]:
    tv = str(manifest.get("triton_version"))
    return {(tv, k["key"]) for u in manifest.get("units", {}).values() for k in u.get("kernels", [])}


def units_without_kernels(manifest: dict[str, Any]) -> set[str]:
    """The manifest's units some of whose cache entries are gone (a clean, a cache wiped by hand): they are
    not built any more, whatever the manifest says."""
    root, tv = manifest_root(manifest), str(manifest.get("triton_version"))
    return {name for name, u in manifest.get("units", {}).items()
            if not all(cache.present(k["key"], tv, root) for k in u.get("kernels", []))}


def register(manifest_path: Path, root: Path) -> None:
    """Record in the cache that the package whose manifest is at ``manifest_path`` uses its entries (called by
    the build once the manifest is written), so that cleaning another spec keeps them."""
    path = str(manifest_path.resolve())
    name = hashlib.sha256(path.encode()).hexdigest()[:24]
    try:
        cache.atomic_write_text(root / REGISTRY / f"{name}.json", json.dumps({"manifest": path}) + "\n")
    except OSError:  # a cache shared read-only: its owner's cleans cannot know this package, the build still stands
        pass


def known_manifests(root: Path, generated: Path) -> list[Path]:
    """Every manifest that may name entries of the cache at ``root``: those under ``generated`` and those the
    registry names (records of manifests that no longer exist are dropped)."""
    found = {m.resolve() for m in generated.glob("*/manifest.json")}
    for rec in sorted((root / REGISTRY).glob("*.json")):
        try:
            path = Path(json.loads(rec.read_text())["manifest"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if path.is_file():
            found.add(path)
        else:
            rec.unlink(missing_ok=True)
    return sorted(found)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def entries_in_use(root: Path, generated: Path, besides: Path | None = None) -> set[Entry]:
    """The entries of the cache at ``root`` that some package (other than the one whose manifest is ``besides``)
    or on-demand record names."""
    skip = besides.resolve() if besides else None
    used: set[Entry] = set()
    for m in known_manifests(root, generated):
        manifest = read_json(m)
        if m == skip or manifest is None or manifest_root(manifest).resolve() != root.resolve():
            continue
        used |= manifest_entries(manifest)
    for rec in root.glob(f"triton-*/{ONDEMAND}/*/*.json"):
        data = read_json(rec)
        tv = rec.parents[2].name.removeprefix("triton-")
        used |= {(tv, key) for _, key in (data or {}).get("kernels", [])}
    return used


@dataclass
class Removed:
    entries: int = 0
    bytes: int = 0
    kept: int = 0  # entries the cleaned package named that another package or on-demand record still uses
    releases: list[str] = field(default_factory=list)  # Triton releases whose whole folder went


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove_entries(entries: Iterable[Entry], root: Path) -> Removed:
    """Remove cache entries, with the direct-launch records this or another machine kept of them."""
    from . import launch_direct

    out = Removed()
    gone = []
    for tv, key in sorted(entries):
        d = cache.entry_dir(key, tv, root)
        if d.is_dir():
            out.bytes += size_of(d)
            shutil.rmtree(d, ignore_errors=True)
            out.entries += 1
            gone.append((tv, key))
    launch_direct.forget(gone, root)
    return out


def clean_package(manifest_path: Path, generated: Path) -> Removed:
    """Remove a package's manifest and the cache entries it names that nothing else uses. Call under the
    package's build lock."""
    manifest = read_json(manifest_path)
    if manifest is None:
        return Removed()
    root = manifest_root(manifest)
    mine = manifest_entries(manifest)
    shared = mine & entries_in_use(root, generated, besides=manifest_path)
    removed = remove_entries(mine - shared, root)
    removed.kept = len(shared)
    manifest_path.unlink(missing_ok=True)
    return removed


@dataclass
class CacheSize:
    entries: int
    bytes: int
    releases: list[str]


def measure(root: Path) -> CacheSize:
    """What the whole cache holds: complete entries (kernels, launch stubs), bytes on disk, Triton releases."""
    releases = sorted(p.name.removeprefix("triton-") for p in root.glob("triton-*") if p.is_dir())
    entries = sum(1 for _ in root.glob(f"triton-*/*/*/{cache.META}"))
    return CacheSize(entries, size_of(root) if root.is_dir() else 0, releases)


def remove_all(root: Path, generated: Path) -> CacheSize:
    """Remove the whole cache at ``root`` and every manifest under ``generated`` (they would name entries that
    are gone); returns what the cache held."""
    size = measure(root)
    shutil.rmtree(root, ignore_errors=True)
    for m in generated.glob("*/manifest.json"):
        m.unlink()
    return size

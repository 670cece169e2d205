"""Triton's host-side launch stubs (C modules its CUDA driver compiles): built ahead of the first launch, and
kept in dplr-gen's cache so a fresh Triton cache does not compile them again."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sysconfig
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from .launch import LoadedKernel

# Triton's CUDA driver compiles these C modules with the system C compiler; they hold no kernel code.
_DRIVER_MODULES = ("__triton_launcher", "cuda_utils")
_DRIVER_MODULE_KIND = "triton driver module"  # what their entries in dplr-gen's cache say they are
_DRIVER_BUILDS = threading.Lock()


@contextlib.contextmanager
def driver_modules_kept_in(root: Path, triton_version: str) -> Iterator[None]:
    """While active, the C modules Triton's CUDA driver compiles (its utilities and each kernel's launch stub)
    are also kept in dplr-gen's cache at ``root``, and a later process whose Triton cache lacks them finds
    them there instead of compiling them again.

    Why: Triton compiles them at a kernel's first launch (about 0.4 s each on the H100 machine) into its own
    cache only, so a fresh node or an empty TRITON_CACHE_DIR pays for them again although dplr-gen's cache
    holds the kernels themselves. A stored module is put back into Triton's cache under Triton's key (the C
    source and the platform, as ``compile_module_from_src`` computes it) just before Triton looks.
    Best effort: a release that builds them another way finds nothing and compiles as it always does.
    """
    from . import cache

    try:
        import triton.backends.nvidia.driver as nv
        from triton.runtime.build import platform_key
        from triton.runtime.cache import get_cache_manager
    except ImportError:
        yield
        return
    original = getattr(nv, "compile_module_from_src", None)
    if original is None:
        yield
        return
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"

    def build(src: str, name: str, *args: Any, **kwargs: Any) -> Any:
        if name not in _DRIVER_MODULES:
            return original(src, name, *args, **kwargs)
        file = f"{name}{suffix}"
        key = cache.cache_key(what=_DRIVER_MODULE_KIND, src=src, name=name, platform=platform_key(), ext=suffix)
        entry = cache.entry_dir(key, triton_version, root)
        meta = cache.read_entry(key, triton_version, root)
        stored = False
        if meta is not None:
            try:
                data = (entry / file).read_bytes()
                # a damaged copy is not offered to Triton; it is replaced below by the one Triton builds
                stored = hashlib.sha256(data).hexdigest() == meta.get("sha256")
                manager = get_cache_manager(hashlib.sha256((src + platform_key()).encode()).hexdigest())
                if stored and manager.get_file(file) is None:
                    manager.put(data, file, binary=True)
            except OSError:
                pass
        module = original(src, name, *args, **kwargs)
        if not stored:
            try:
                data = Path(module.__file__).read_bytes()
                with cache.locked(key, triton_version, root):
                    if meta is not None:
                        shutil.rmtree(entry, ignore_errors=True)
                    cache.write_entry(key, triton_version, {file: data}, {
                        "kind": _DRIVER_MODULE_KIND, "name": name, "file": file,
                        "sha256": hashlib.sha256(data).hexdigest()}, root)
            except (OSError, TypeError):
                pass
        return module

    with _DRIVER_BUILDS:
        nv.compile_module_from_src = build
        try:
            yield
        finally:
            nv.compile_module_from_src = original


def driver_builds_lock() -> threading.Lock:
    """Held while Triton's driver's C-module loader is wrapped (here, and by a direct launch's capture)."""
    return _DRIVER_BUILDS


def kept_driver_modules(root: Path, triton_version: str) -> int:
    """How many C modules of Triton's driver (see :func:`driver_modules_kept_in`) dplr-gen's cache holds."""
    from . import cache

    return sum(meta.get("kind") == _DRIVER_MODULE_KIND for meta in cache.entries(triton_version, Path(root)))


def _launcher_identity(k: LoadedKernel) -> Any:
    """What a kernel's launch stub is generated from (its argument types and constants): kernels alike in
    these share one stub, so it is built once."""
    src = k.compiled.src
    try:
        return repr((sorted(src.signature.items()), sorted(src.constants.items(), key=repr),
                     getattr(k.compiled.metadata, "tensordesc_meta", None)))
    except (AttributeError, TypeError):
        return id(k)


def warm_launchers(kernels: Iterable[LoadedKernel], keep_in: tuple[Path, str] | None = None) -> None:
    """Build the host-side launch stubs of ``kernels`` now, concurrently (no device work).

    Triton builds one small C launcher per kernel signature with the system C compiler at the first launch
    and caches it: about 0.4 s each on the H100 machine, one after the other, 1.7 s of a cold start
    (scripts/cold_start.py). Built here in threads (the compiler runs as a subprocess), the first launches
    find them in Triton's cache. With ``keep_in=(cache root, Triton version)`` they are also kept in (and
    first looked up in) dplr-gen's cache: see :func:`driver_modules_kept_in`. Best effort: on any error the
    stubs get built at first launch as usual.
    """
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime import driver

    ks = list({_launcher_identity(k): k for k in kernels}.values())
    if not ks:
        return

    def build(k: LoadedKernel) -> None:
        try:
            driver.active.launcher_cls(k.compiled.src, k.compiled.metadata)
        except Exception:  # noqa: BLE001 - only a head start; the first launch builds it otherwise
            pass

    kept = driver_modules_kept_in(*keep_in) if keep_in else contextlib.nullcontext()
    with kept, ThreadPoolExecutor(min(len(ks), 32)) as pool:
        list(pool.map(build, ks))

"""The one place that speaks to each Triton release's compiler API (Triton 3.1 to 3.9).

Everything here works on a machine with no GPU except ``load_kernel(...)[grid](...)``, which launches.

What differs between releases (read from each release's source, checked by compiling with each):

* ``ASTSource``: before 3.3 it takes ``constants=`` keyed by argument *name* (3.2 rejects non-str keys;
  3.1's ``CompiledKernel.launch_metadata`` looks constants up by name) and a signature holding the runtime
  arguments only. From 3.3 it takes ``constexprs=`` and a signature holding every argument, constexpr ones
  typed ``"constexpr"``.
* Pointer alignment (the ``tt.divisibility = 16`` the JIT gives 16-byte aligned pointers): 3.1 a dataclass
  ``AttrsDescriptor(divisible_by_16, equal_to_1)`` of argument indices; 3.2 a class
  ``AttrsDescriptor.from_hints({index: 16})``; from 3.3 a plain dict ``{(index,): [["tt.divisibility", 16]]}``.
* Launch: the generated launcher parses one Python argument per entry of ``src.signature``. Before 3.3
  that is runtime arguments only; from 3.3 it includes the constexpr ones (values ignored). ``load_kernel``
  builds the argument list from the signature itself, so callers always pass runtime arguments only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from packaging.version import Version

# Oldest and newest releases this adapter was checked against; newer ones are tried but flagged.
MIN_TRITON = Version("3.1.0")
MAX_TESTED_TRITON = Version("3.9.0")

# arch -> first Triton release that can compile for it. Seen with 3.1.0 and 3.2.0: for sm_100 and sm_120
# any tl.dot aborts the process (AccelerateMatmul.cpp "computeCapability not supported", SIGABRT) and a
# dot-free kernel fails in ptxas ("Value 'sm_100' is not defined for option 'gpu-name'").
KNOWN_ARCHS: dict[int, Version] = {
    75: Version("3.1.0"),
    80: Version("3.1.0"),
    86: Version("3.1.0"),
    87: Version("3.1.0"),
    89: Version("3.1.0"),
    90: Version("3.1.0"),
    100: Version("3.3.0"),
    120: Version("3.3.0"),
}

# File name extensions Triton writes into its cache group for one CUDA kernel.
_ARTIFACT_EXTS = ("json", "cubin", "ptx", "llir", "ttgir", "ttir", "source")


class TargetUnsupported(ValueError):
    """Raised instead of asking a Triton release to compile for an arch it cannot target."""


def triton_version() -> Version:
    """The installed Triton's version, read from package metadata (no import of triton: that is slow)."""
    try:
        return Version(importlib.metadata.version("triton"))
    except importlib.metadata.PackageNotFoundError:
        import triton  # a source build without dist-info still has __version__

        return Version(triton.__version__)


def _base(version: Version | str | None) -> Version:
    """Drop local/dev/pre parts (``3.6.0+git1234`` -> ``3.6.0``) so range checks compare releases."""
    v = triton_version() if version is None else Version(str(version))
    return Version(v.base_version)


def can_target(arch: int, version: Version | str | None = None) -> tuple[bool, str]:
    """Whether Triton ``version`` (default: installed) can compile for ``sm_<arch>`` without aborting.

    Consulted before compiling: a release asked for an arch it lacks may kill the whole process.
    Returns ``(ok, reason)``; reason is empty when ok and nothing is worth saying.
    """
    v = _base(version)
    if v < MIN_TRITON:
        return False, f"Triton {v} is older than the oldest supported release {MIN_TRITON}"
    first = KNOWN_ARCHS.get(int(arch))
    if first is None:
        known = ", ".join(f"sm_{a}" for a in sorted(KNOWN_ARCHS))
        return False, f"sm_{arch} is not a known target (known: {known})"
    if v < first:
        return False, f"Triton {v} cannot target sm_{arch} (first release that can: {first}); it aborts when asked"
    if v.release[:2] > MAX_TESTED_TRITON.release[:2]:
        return True, f"Triton {v} is newer than the newest checked release {MAX_TESTED_TRITON}"
    return True, ""


# ----------------------------------------------------------------------------------------------------------
# Source construction


def _arg_names(fn: Any) -> list[str]:
    """Kernel argument names in order (``JITFunction.arg_names`` exists on every 3.x release)."""
    names = getattr(fn, "arg_names", None)
    if names is None:
        names = list(inspect.signature(fn.fn).parameters)
    return list(names)


def _attrs_style() -> str:
    """How the installed release expresses argument attributes: 'dataclass31', 'descriptor32' or 'dict'."""
    from triton.compiler import compiler as tc

    if hasattr(tc, "AttrsDescriptor") and "divisible_by_16" in getattr(tc.AttrsDescriptor, "__dataclass_fields__", {}):
        return "dataclass31"
    try:
        from triton.backends.compiler import AttrsDescriptor  # noqa: F401  (3.2 only)

        return "descriptor32"
    except ImportError:
        return "dict"


def _uses_constexprs_kw() -> bool:
    """True from 3.3 on: ``ASTSource(fn, signature, constexprs=..., attrs=...)`` with constexprs in signature."""
    from triton.compiler import ASTSource

    return "constexprs" in inspect.signature(ASTSource.__init__).parameters


def is_gluon(fn: Any) -> bool:
    """Whether ``fn`` is a ``@gluon.jit`` kernel (Triton's explicit-layout dialect, compiled from its own source
    class); releases without Gluon have no such kernels."""
    probe = getattr(fn, "is_gluon", None)
    return bool(probe()) if callable(probe) else False


def make_source(
    fn: Any,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    *,
    pointer_divisibility: bool = True,
    divisible_args: Iterable[str] = (),
) -> Any:
    """Build an ``ASTSource`` for the installed Triton release.

    ``signature``: runtime arguments only, name -> Triton type (``"*bf16"``, ``"i32"``, ``"fp32"``...).
    ``constexprs``: constexpr arguments, name -> value. Together they must name every kernel argument.
    ``pointer_divisibility``: give every pointer argument ``tt.divisibility = 16`` as the JIT does for
    16-byte aligned tensors (so AOT code vectorises like JIT code); the caller must then only pass
    16-byte aligned pointers. ``divisible_args``: further (integer) arguments promised divisible by 16.
    """
    from triton.compiler import ASTSource

    names = _arg_names(fn)
    given = set(signature) | set(constexprs)
    if set(signature) & set(constexprs):
        raise ValueError(f"arguments both runtime and constexpr: {sorted(set(signature) & set(constexprs))}")
    if given != set(names):
        raise ValueError(f"{fn.__name__}: missing {sorted(set(names) - given)}, unknown {sorted(given - set(names))}")
    index = {n: i for i, n in enumerate(names)}
    div = {n for n, t in signature.items() if pointer_divisibility and t.startswith("*")}
    extra = set(divisible_args)
    if extra - set(signature):
        raise ValueError(f"divisible_args not among runtime args: {sorted(extra - set(signature))}")
    div_idx = sorted(index[n] for n in div | extra)

    style = _attrs_style()
    if style == "dataclass31":
        from triton.compiler.compiler import AttrsDescriptor

        attrs: Any = AttrsDescriptor(divisible_by_16=tuple(div_idx), equal_to_1=())
    elif style == "descriptor32":
        from triton.backends.compiler import AttrsDescriptor

        attrs = AttrsDescriptor.from_hints({i: 16 for i in div_idx})
    else:
        attrs = {(i,): [["tt.divisibility", 16]] for i in div_idx}

    if _uses_constexprs_kw():
        # every argument, in kernel order, constexpr ones typed "constexpr"
        full = {n: ("constexpr" if n in constexprs else signature[n]) for n in names}
        if is_gluon(fn):
            from triton.experimental.gluon._runtime import GluonASTSource

            return GluonASTSource(fn, full, constexprs=dict(constexprs), attrs=attrs)
        return ASTSource(fn, full, constexprs=dict(constexprs), attrs=attrs)
    if is_gluon(fn):
        import triton

        raise TypeError(f"{fn.__name__} is a Gluon kernel; Triton {triton.__version__} has no Gluon compiler")
    # before 3.3: runtime args only, in kernel order; constants keyed by name (what the 3.1/3.2 JIT does)
    runtime = {n: signature[n] for n in names if n in signature}
    return ASTSource(fn, runtime, constants=dict(constexprs), attrs=attrs)


# ----------------------------------------------------------------------------------------------------------
# Compilation


@dataclass
class CompileResult:
    """Everything one AOT compile produced.

    ``files``: Triton's cache-group files by their Triton names (``<kernel>.json``, ``.cubin``, ``.ptx``,
    ``.ttgir``, ``.ttir``, ``.llir``, ...); write them into one folder and ``load_kernel`` reloads them.
    ``metadata``: json-able summary (``triton_metadata`` holds Triton's own json verbatim).
    """

    files: dict[str, bytes]
    metadata: dict[str, Any]
    ttgir: str
    shared: int
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def hash(self) -> str:
        return str(self.metadata["hash"])

    def write(self, directory: Path) -> list[Path]:
        """Write ``files`` into ``directory`` (created); returns the paths written."""
        directory.mkdir(parents=True, exist_ok=True)
        out = []
        for name, data in sorted(self.files.items()):
            p = directory / name
            p.write_bytes(data)
            out.append(p)
        return out


@contextlib.contextmanager
def private_triton_cache() -> Iterator[Path]:
    """Point Triton's cache at a fresh temporary folder for the duration, then remove it.

    A fresh folder means no stale hit from the user's cache and nothing left in it. Triton >= 3.4 reads
    ``knobs.cache.dir`` (env-backed unless set in code), older releases read ``TRITON_CACHE_DIR`` when
    the cache manager is made: we set both.
    """
    tmp = Path(tempfile.mkdtemp(prefix="dplr_triton_cache_"))
    old_env = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp)
    knobs = None
    old_knob: Any = None
    try:
        import triton

        knobs = getattr(triton, "knobs", None)
        if knobs is not None and "dir" in knobs.cache.__dict__:
            old_knob = knobs.cache.__dict__["dir"]
            knobs.cache.dir = str(tmp)
        yield tmp
    finally:
        if old_env is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old_env
        if knobs is not None and old_knob is not None:
            knobs.cache.dir = old_knob
        shutil.rmtree(tmp, ignore_errors=True)


def _cache_group_files(ck: Any, cache_dir: Path, stem: str) -> dict[str, bytes]:
    """The kernel's artifacts as Triton named them in its cache group.

    ``CompiledKernel.metadata_group`` exists from 3.2; on 3.1 we read the (private, fresh) cache folder.
    """
    group = getattr(ck, "metadata_group", None)
    if group:
        return {Path(p).name: Path(p).read_bytes() for p in group.values()}
    metas = [p for p in cache_dir.rglob(f"{stem}.json")]
    if len(metas) != 1:
        raise RuntimeError(f"expected one {stem}.json in the private Triton cache, found {len(metas)}")
    return {f"{stem}.{ext}": (metas[0].parent / f"{stem}.{ext}").read_bytes() for ext in _ARTIFACT_EXTS
            if (metas[0].parent / f"{stem}.{ext}").is_file()}


@contextlib.contextmanager
def without_interpreter() -> Iterator[None]:
    """Unset ``TRITON_INTERPRET`` for the duration: import kernel modules meant for AOT compiles inside it.

    ``@triton.jit`` reads the variable when a kernel is *defined* and then builds an interpreter-only
    object that ``triton.compile`` cannot take.
    """
    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


# Triton's interpreter (seen in 3.6) patches triton.language in place while it runs a kernel and, when the
# kernel calls another @triton.jit function, never undoes the inner patch: afterwards every real compile in
# that process fails ("'ir.value' object has no attribute 'dtype'"). We snapshot the language objects
# while they are clean and put them back before compiling.
_LANG_SNAPSHOT: list[tuple[Any, dict[str, Any]]] | None = None


def _lang_objects() -> list[Any]:
    import triton.language as tl

    objs = [tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype]
    tdb = getattr(tl.core, "tensor_descriptor_base", None)
    return objs + ([tdb] if tdb is not None else [])


def snapshot_language() -> None:
    """Record triton.language while it is clean (once per process); call before running interpreted kernels."""
    global _LANG_SNAPSHOT
    if _LANG_SNAPSHOT is not None:
        return
    import triton.language as tl

    if not tl.core.is_builtin(tl.program_id):  # already patched by the interpreter: not a clean state
        return
    _LANG_SNAPSHOT = [(o, dict(vars(o))) for o in _lang_objects()]


def repair_triton_language() -> bool:
    """Undo interpreter patches left on ``triton.language``; True if anything had to be restored.

    Raises RuntimeError when the language is patched and no clean snapshot was taken (import this module
    before running interpreted kernels, or compile in a fresh process).
    """
    import triton.language as tl

    snapshot_language()
    if _LANG_SNAPSHOT is None:
        if not tl.core.is_builtin(tl.program_id):
            raise RuntimeError("triton.language was left patched by Triton's interpreter before dplr_gen could "
                               "snapshot it; compile in a fresh process")
        return False
    # Only a part of a patch may be left (an outer scope restores what it patched too), so compare all.
    changed = False
    for obj, saved in _LANG_SNAPSHOT:
        current = dict(vars(obj))
        if isinstance(obj, type):  # the interpreter adds dunders to classes; modules gain submodules legitimately
            for k in current.keys() - saved.keys():
                delattr(obj, k)
                changed = True
        for k, v in saved.items():
            if current.get(k, _MISSING) is not v:
                setattr(obj, k, v)
                changed = True
    return changed


_MISSING = object()

if "triton.language" in sys.modules:  # cheap here; if not imported yet, the first compile snapshots
    snapshot_language()


def _check_compilable(fn: Any) -> None:
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        hint = (" (it was defined while TRITON_INTERPRET=1: import its module inside "
                "triton_compat.without_interpreter())" if type(fn).__name__ == "InterpretedFunction" else "")
        raise TypeError(f"{getattr(fn, '__name__', fn)!r} is not a @triton.jit kernel Triton can compile{hint}")


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)


def compile_kernel(
    fn: Any,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    arch: int,
    num_warps: int,
    num_stages: int,
    extra_options: Mapping[str, Any] | None = None,
    *,
    pointer_divisibility: bool = True,
    divisible_args: Iterable[str] = (),
) -> CompileResult:
    """Compile ``fn`` ahead of time for ``sm_<arch>`` with the installed Triton; no GPU needed.

    Raises ``TargetUnsupported`` (without touching Triton) when ``can_target`` says no. A compiler
    *abort* still kills the process: callers run each compile in its own subprocess.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    ok, why = can_target(arch)
    if not ok:
        raise TargetUnsupported(why)
    _check_compilable(fn)
    repair_triton_language()
    src = make_source(fn, signature, constexprs, pointer_divisibility=pointer_divisibility,
                      divisible_args=divisible_args)
    options = {"num_warps": int(num_warps), "num_stages": int(num_stages), **dict(extra_options or {})}
    t0 = time.perf_counter()
    with private_triton_cache() as cache_dir:
        ck = triton.compile(src, target=GPUTarget("cuda", int(arch), 32), options=options)
        # read while the cache folder still exists
        files = _cache_group_files(ck, cache_dir, src.name[:150])
    seconds = time.perf_counter() - t0
    name = ck.metadata.name
    meta_name = next(n for n in files if n.endswith(".json"))
    triton_meta = json.loads(files[meta_name])
    ttgir = files.get(f"{Path(meta_name).stem}.ttgir", b"").decode()
    shared = int(triton_meta.get("shared", ck.metadata.shared))
    metadata = {
        "name": name,
        "hash": ck.hash,
        "arch": int(arch),
        "target": f"sm_{arch}",
        "num_warps": int(triton_meta.get("num_warps", num_warps)),
        "num_stages": int(triton_meta.get("num_stages", num_stages)),
        "shared": shared,
        "triton_version": str(triton.__version__),
        "signature": dict(signature),
        "constexprs": _jsonable(dict(constexprs)),
        "pointer_divisibility": pointer_divisibility,
        "divisible_args": sorted(divisible_args),
        "options": _jsonable(options),
        "metadata_file": meta_name,
        "compile_seconds": round(seconds, 3),
        "triton_metadata": triton_meta,
    }
    return CompileResult(files=files, metadata=metadata, ttgir=ttgir, shared=shared, seconds=seconds,
                         warnings=[why] if why else [])


# ----------------------------------------------------------------------------------------------------------
# Loading and launching (GPU side)


class LoadedKernel:
    """A launchable kernel rebuilt from persisted files: ``kernel[grid](*runtime_args, stream=None)``."""

    def __init__(self, compiled: Any, order: list[tuple[str, bool]], constexprs: Mapping[str, Any]) -> None:
        self.compiled = compiled  # triton CompiledKernel (internal API: don't reach into it elsewhere)
        # (name, is_constexpr) for each argument the launcher parses, in launcher order
        self._order = order
        self._constexprs = dict(constexprs)
        self.n_runtime = sum(1 for _, c in order if not c)

    @property
    def metadata(self) -> Any:
        return self.compiled.metadata

    def resources(self) -> dict[str, Any]:
        """Registers per thread and spilled bytes of the loaded binary (loads it on the device); {} if unknown."""
        try:
            self.compiled._init_handles()
        except Exception:  # noqa: BLE001 - informational only
            return {}
        return {k: getattr(self.compiled, k, None) for k in ("n_regs", "n_spills")}

    def __getitem__(self, grid: int | Sequence[int]) -> Callable[..., None]:
        g = (grid,) if isinstance(grid, int) else tuple(grid)
        g = (g + (1, 1, 1))[:3]  # CompiledKernel indexes grid[0..2]
        launch = self.compiled[g]
        order, consts, n = self._order, self._constexprs, self.n_runtime

        def run(*args: Any, stream: Any = None) -> None:
            if len(args) != n:
                raise TypeError(f"{self.compiled.name} takes {n} runtime arguments, got {len(args)}")
            it = iter(args)
            # launcher arity follows src.signature: constexpr slots exist only from 3.3 on
            full = [consts[name] if is_c else next(it) for name, is_c in order]
            launch(*full, stream=stream)

        return run


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


def load_kernel(
    fn: Any,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    files_dir: Path,
    hash: str,
    *,
    pointer_divisibility: bool = True,
    divisible_args: Iterable[str] = (),
) -> LoadedKernel:
    """Rebuild a launchable kernel from files written by ``CompileResult.write`` (no recompile).

    Only ``<kernel name>.<ext>`` files of ``files_dir`` are used, so other json files may sit beside them.
    Signature/constexprs (and the divisibility flags) must be those it was compiled with.
    """
    from triton.compiler.compiler import CompiledKernel

    src = make_source(fn, signature, constexprs, pointer_divisibility=pointer_divisibility,
                      divisible_args=divisible_args)
    files_dir = Path(files_dir)
    stem = src.name[:150]  # Triton's own file-name truncation
    group = {f"{stem}.{ext}": str(files_dir / f"{stem}.{ext}") for ext in _ARTIFACT_EXTS
             if (files_dir / f"{stem}.{ext}").is_file()}
    if f"{stem}.json" not in group or f"{stem}.cubin" not in group:
        raise FileNotFoundError(f"{files_dir}: need {stem}.json and {stem}.cubin")
    # CompiledKernel takes the first *.json it meets as metadata: put it first
    group = {f"{stem}.json": group.pop(f"{stem}.json"), **group}
    compiled = CompiledKernel(src, group, hash)
    order = [(name, ty == "constexpr") for name, ty in src.signature.items()]
    return LoadedKernel(compiled, order, constexprs)


# ----------------------------------------------------------------------------------------------------------
# TTGIR inspection

_ALIAS_RE = re.compile(r"^(#[\w.$-]+)\s*=\s*(.+?)\s*$")
_ALIAS_USE_RE = re.compile(r"#[A-Za-z_][\w$-]*(?![\w.<])")


def _match_close(s: str, start: int) -> int:
    """Index of the bracket closing the one at ``s[start]`` (nesting of <>, {}, (), [] and strings)."""
    pairs = {"<": ">", "{": "}", "(": ")", "[": "]"}
    stack: list[str] = []
    i = start
    in_str = False
    while i < len(s):
        c = s[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
        elif c == ">" and s[i - 1] == "-":  # "->" inside an attribute is not a bracket
            pass
        i += 1
    return -1


def _split_top(s: str) -> list[str]:
    """Split on commas that are not nested in brackets."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "<{([":
            depth += 1
        elif c in ">})]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _tensor_encoding(s: str, start: int) -> tuple[str | None, int]:
    """Encoding of the first ``tensor<...>`` at or after ``start``; returns (encoding, end index)."""
    i = s.find("tensor<", start)
    if i < 0:
        return None, -1
    j = _match_close(s, i + len("tensor"))
    if j < 0:
        return None, -1
    parts = _split_top(s[i + len("tensor<"):j])
    return (parts[1] if len(parts) > 1 else None), j + 1


def ttgir_aliases(ttgir: str) -> dict[str, str]:
    """The ``#name = <attribute>`` definitions at the top of a TTGIR module, nested aliases resolved."""
    raw: dict[str, str] = {}
    for line in ttgir.splitlines():
        m = _ALIAS_RE.match(line)
        if m and not m.group(1).startswith("#loc"):
            raw[m.group(1)] = m.group(2)

    @functools.lru_cache(maxsize=None)
    def resolve(name: str, depth: int = 0) -> str:
        body = raw[name]
        if depth > 8:
            return body
        return _ALIAS_USE_RE.sub(lambda m: resolve(m.group(0), depth + 1) if m.group(0) in raw else m.group(0), body)

    return {k: resolve(k) for k in raw}


def _resolve(enc: str, aliases: Mapping[str, str]) -> str:
    return _ALIAS_USE_RE.sub(lambda m: aliases.get(m.group(0), m.group(0)), enc)


def _is_mma(enc: str, raw_enc: str) -> bool:
    # "#ttg.nvidia_mma<" (3.3+), "#triton_gpu.nvidia_mma<" (3.1/3.2); an unresolved "#mma" alias counts too
    # the encoding itself, not one nesting it (a dot_op whose parent is an mma is not an mma)
    return bool(re.match(r"#[\w.]*nvidia_mma<", enc.strip())) or bool(re.fullmatch(r"#mma\d*", raw_enc.strip()))


def _dot_op_parent(enc: str) -> str | None:
    """Parent encoding of a (resolved) ``dot_op<{... parent = X ...}>`` encoding, else None."""
    m = re.search(r"\.dot_op<", enc)
    if not m:
        return None
    j = _match_close(enc, m.end() - 1)
    body = enc[m.end():j].strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    for part in _split_top(body):
        k, _, v = part.partition("=")
        if k.strip() == "parent":
            return v.strip()
    return None


def mma_conversions(ttgir: str, *, include_dot_operands: bool = False) -> list[str]:
    """Lines of ``ttgir`` holding a ``convert_layout`` between two DIFFERENT nvidia_mma encodings.

    Aliases (``#mma``, ``#mma1``...) are resolved to their full definitions before comparing. This is the
    conversion Triton 3.0/3.1 abort on ("mma -> mma layout conversion is only supported on Ampere").
    ``include_dot_operands`` also flags mma -> ``dot_op`` whose parent is a different mma encoding (a
    dot result fed as operand to a dot of another layout), which 3.6 emits for chained dots at 8 warps.
    """
    aliases = ttgir_aliases(ttgir)
    found = []
    for line in ttgir.splitlines():
        k = line.find("convert_layout")
        if k < 0:
            continue
        colon = line.find(" : ", k)
        if colon < 0:
            continue
        src_raw, end = _tensor_encoding(line, colon)
        if src_raw is None:
            continue
        arrow = line.find("->", end)
        dst_raw, _ = _tensor_encoding(line, arrow) if arrow >= 0 else (None, -1)
        if dst_raw is None:
            continue
        src, dst = _resolve(src_raw, aliases), _resolve(dst_raw, aliases)
        if not _is_mma(src, src_raw):
            continue
        if _is_mma(dst, dst_raw):
            if src != dst:
                found.append(line.strip())
        elif include_dot_operands:
            parent = _dot_op_parent(dst)
            if parent is not None and _is_mma(parent, parent) and parent != src:
                found.append(line.strip())
    return found


# ----------------------------------------------------------------------------------------------------------
# Probe kernels and a self check (what a `dplr-gen compat` command can call)

# Written to a real file: @triton.jit needs inspect.getsource. Byte-identical every time (cache key).
PROBE_SOURCE = '''\
import triton
import triton.language as tl


@triton.jit
def probe_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def probe_dot(a_ptr, b_ptr, c_ptr, BT: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, BT)
    c = tl.arange(0, D)
    a = tl.load(a_ptr + r[:, None] * D + c[None, :])
    b = tl.load(b_ptr + c[:, None] * BT + r[None, :])
    tl.store(c_ptr + r[:, None] * BT + r[None, :], tl.dot(a, b).to(c_ptr.dtype.element_ty))


@triton.jit
def probe_chain(q_ptr, k_ptr, v_ptr, w_ptr, o_ptr, stride, BT: tl.constexpr, D: tl.constexpr):
    # chunk-style: three chained dots, one result combined with another dot's result
    base = tl.program_id(0) * BT * stride
    r = tl.arange(0, BT)
    c = tl.arange(0, D)
    offs = base + r[:, None] * stride + c[None, :]
    q = tl.load(q_ptr + offs)
    k = tl.load(k_ptr + offs)
    v = tl.load(v_ptr + offs)
    w = tl.load(w_ptr + offs)
    a = tl.dot(q, tl.trans(k))
    a = tl.where(r[:, None] >= r[None, :], a, 0.0)
    u = tl.dot(w, v)
    b = tl.dot(a.to(v.dtype), v, u)
    o = tl.dot(b.to(v.dtype), tl.trans(w)) + a
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty))
'''

# kernel name -> (signature, constexprs)
PROBES: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "probe_add": ({"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 1024}),
    "probe_dot": ({"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32"}, {"BT": 64, "D": 64}),
    "probe_chain": ({"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16",
                     "stride": "i32"}, {"BT": 64, "D": 64}),
}


@functools.lru_cache(maxsize=1)
def probe_module() -> Any:
    """Import the probe kernels (written once to a temp file named by the source's content)."""
    import hashlib

    digest = hashlib.sha256(PROBE_SOURCE.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"dplr_gen_probe_{digest}.py"
    if not path.is_file() or path.read_text() != PROBE_SOURCE:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(PROBE_SOURCE)
        os.replace(tmp, path)  # atomic: parallel processes never see half a file
    spec = importlib.util.spec_from_file_location(f"dplr_gen_probe_{digest}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    with without_interpreter():  # probes are for compiling, even inside an interpreter test session
        spec.loader.exec_module(mod)
    return mod


def probe(kernel: str, arch: int, num_warps: int = 4, num_stages: int = 2) -> dict[str, Any]:
    """Compile one probe kernel in this process; returns a json-able summary (raises on failure)."""
    sig, consts = PROBES[kernel]
    res = compile_kernel(getattr(probe_module(), kernel), sig, consts, arch, num_warps, num_stages)
    return {
        "kernel": kernel, "arch": arch, "num_warps": num_warps, "num_stages": num_stages, "ok": True,
        "triton_version": res.metadata["triton_version"], "shared": res.shared,
        "seconds": round(res.seconds, 3), "files": sorted(res.files),
        "mma_conversions": len(mma_conversions(res.ttgir)),
        "mma_dot_operand_conversions": len(mma_conversions(res.ttgir, include_dot_operands=True)),
    }


def probe_subprocess(kernel: str, arch: int, num_warps: int = 4, num_stages: int = 2,
                     python: str | None = None, timeout: float = 600) -> dict[str, Any]:
    """``probe`` in a child process, so a compiler abort (SIGABRT) is reported instead of killing us.

    ``python``: another interpreter (e.g. a venv with a different Triton) to run it with.
    """
    import subprocess

    ok, why = can_target(arch, _child_version(python) if python else None)
    if not ok:
        return {"kernel": kernel, "arch": arch, "num_warps": num_warps, "ok": False, "skipped": True, "error": why}
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [python or sys.executable, "-m", "dplr_gen.triton_compat", kernel, str(arch), str(num_warps), str(num_stages)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode == 0 and p.stdout.strip():
        return json.loads(p.stdout.strip().splitlines()[-1])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"kernel": kernel, "arch": arch, "num_warps": num_warps, "ok": False, "returncode": p.returncode,
            "error": " | ".join(tail)}


def _child_version(python: str) -> Version:
    import subprocess

    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('triton'))"],
                         capture_output=True, text=True, check=True).stdout
    return Version(out.strip())


def self_check(archs: Iterable[int] = (80, 86, 89, 90, 100, 120), kernels: Iterable[str] = ("probe_add", "probe_dot"),
               python: str | None = None) -> list[dict[str, Any]]:
    """Compile each probe kernel for each arch, each in its own subprocess; one summary dict per compile."""
    return [probe_subprocess(k, a, python=python) for a in archs for k in kernels]


if __name__ == "__main__":  # child entry of probe_subprocess: prints one json line
    _k, _a, _w, _s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(probe(_k, _a, _w, _s)))

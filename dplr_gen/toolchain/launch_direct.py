"""Launching built kernels without importing Triton: its C launch stub called directly.

Triton launches a compiled kernel through Python layers (the compiled kernel's runner, the driver proxy that finds
the stream, the launcher object) down to a C function of a small module it compiles per kernel signature (the
launch stub), and loads the binary through another (its CUDA utilities). Importing Triton is a third of a fresh
process's start, and the Python layers are a part of every launch's host time. Both C modules are kept in
dplr-gen's cache (``launch_stubs``); what the Python layers add to the C function's arguments (the grid, the
stream and the function handle at their places, the launch flags and packed metadata, the constexpr slots a
release keeps) is captured once per kernel on this machine, from a call through Triton's own runner with the C
function swapped for a recorder, and stored beside them: a *direct record*. A later process launches from it:
the C function of the kept stub, called with the recorded arguments and the launch's own.

The capture is exact for the installed release by construction (it records what Triton passes, whatever the
release); a kernel whose launch needs more than the recorded constants (scratch memory, a launch hook) gets no
record and keeps Triton's path. Records are kept per Triton release and per Python platform (the stubs are
extension modules built for one interpreter).
"""

from __future__ import annotations

import _imp
import copy
import hashlib
import importlib.util
import json
import sys
import sysconfig
import threading
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from . import cache

if TYPE_CHECKING:
    from .launch import LoadedKernel

RECORD_VERSION = 1
# what the stubs are built for: the interpreter's ABI tag and the platform
PLATFORM = f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"
_STUB_NAME = "__triton_launcher"  # the module names Triton gives its C modules (their init functions)
_UTILS_NAME = "cuda_utils"


def records_dir(root: Path, triton_version: str) -> Path:
    return Path(root) / f"triton-{triton_version}" / "direct-launch" / PLATFORM


def kept_records(root: Path, triton_version: str) -> int:
    """How many kernels this machine can launch directly from dplr-gen's cache at ``root`` (`dplr-gen doctor`)."""
    return sum(1 for _ in records_dir(root, triton_version).glob("*.json"))


def forget(entries: Iterable[tuple[str, str]], root: Path) -> int:
    """Remove the direct records (every platform's) of the cache entries ``entries`` ((Triton version, key),
    removed by a clean), then the kept C modules no remaining record names; the number of records removed.
    (A record whose kernel is gone is never used, the loader checks the binary; this keeps the cache tidy.)"""
    removed = 0
    by_release: dict[str, set[str]] = {}
    for tv, key in entries:
        by_release.setdefault(tv, set()).add(key)
    for tv, keys in by_release.items():
        for platform in (Path(root) / f"triton-{tv}" / "direct-launch").glob("*"):
            for key in keys:
                rec = platform / f"{key}.json"
                if rec.is_file():
                    rec.unlink(missing_ok=True)
                    removed += 1
            named: set[str] = set()
            for rec in platform.glob("*.json"):
                try:
                    data = json.loads(rec.read_text())
                    named |= {data["stub"], data["utils"]}
                except (OSError, ValueError, KeyError, TypeError):
                    continue
            for module in (platform / "modules").glob("*.so"):
                if module.stem not in named:
                    module.unlink(missing_ok=True)
    return removed


def _record_path(root: Path, triton_version: str, key: str) -> Path:
    return records_dir(root, triton_version) / f"{key}.json"


def _module_path(root: Path, triton_version: str, sha: str) -> Path:
    return records_dir(root, triton_version) / "modules" / f"{sha}.so"


class _Mark:
    """A stand-in argument whose place in the captured call says what it stands for."""

    __slots__ = ("what",)

    def __init__(self, what: Any) -> None:
        self.what = what


# ------------------------------------------------------------------------------------------------ constants


def _encode(value: Any) -> Any:
    """A launch constant as JSON (tuples tagged: the stub parses the packed metadata as a tuple); a ValueError
    for anything else (a hook, a launch-metadata object: such a kernel keeps Triton's path)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    raise ValueError(f"not a recordable launch constant: {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(_decode(v) for v in value["tuple"])
    return value


# ------------------------------------------------------------------------------------------------ capture


def _fresh_launcher(c: Any) -> tuple[Any, str] | None:
    """A new Triton launcher object for compiled kernel ``c`` and the file of the C module it loaded, read as
    the module is loaded: a same-named extension module loaded again in one process shares one module object
    whose attributes the latest load overwrites, so the module a launch function names later is not evidence."""
    import triton.backends.nvidia.driver as nv
    from triton.runtime import driver

    from .launch_stubs import driver_builds_lock

    original = nv.compile_module_from_src
    files: list[str] = []

    def observe(src: str, name: str, *args: Any, **kwargs: Any) -> Any:
        module = original(src, name, *args, **kwargs)
        if name == _STUB_NAME:
            files.append(str(module.__file__))
        return module

    with driver_builds_lock():
        nv.compile_module_from_src = observe
        try:
            launcher = driver.active.launcher_cls(c.src, c.metadata)
        finally:
            nv.compile_module_from_src = original
    return (launcher, files[0]) if len(files) == 1 else None


def capture(kernel: LoadedKernel) -> dict[str, Any] | None:
    """The direct record of ``kernel`` (loaded through Triton, on a GPU: its binary is loaded here), or None
    where its launch needs more than recorded constants. Records what Triton's runner passes to the launch
    stub's C function: the runner runs on a copy of the kernel whose launcher calls a recorder instead."""
    from triton.runtime import driver

    c = kernel.compiled
    c._init_handles()
    fresh = _fresh_launcher(c)
    utils = getattr(getattr(driver.active.utils, "load_binary", None), "__self__", None)
    if fresh is None or getattr(utils, "__name__", None) != _UTILS_NAME:
        return None  # a release whose driver this capture does not know
    launcher, stub_file = fresh
    md = c.metadata
    if any(getattr(o, f"{kind}_scratch_size", 0) for o in (md, launcher) for kind in ("global", "profile")):
        return None  # scratch memory is allocated per launch
    if not callable(getattr(launcher, "launch", None)) or isinstance(launcher.launch, types.FunctionType):
        return None  # a Python wrapper around the C function (tensor descriptors): it transforms arguments
    seen: list[tuple[Any, ...]] = []
    probe = copy.copy(launcher)
    probe.launch = lambda *args: seen.append(args)
    runner = copy.copy(c)
    runner._run = probe
    grid, stream = (_Mark("gx"), _Mark("gy"), _Mark("gz")), _Mark("stream")
    marks = [_Mark(i) for i in range(kernel.n_runtime)]
    full = kernel.launcher_args(marks)
    runner[grid](*full, stream=stream)
    if len(seen) != 1:
        return None
    args = seen[0]
    n = len(full)
    if (len(args) < 5 + n or args[0] is not grid[0] or args[1] is not grid[1] or args[2] is not grid[2]
            or args[3] is not stream or args[4] is not c.function
            or any(a is not f for a, f in zip(args[len(args) - n:], full))):
        return None
    # Triton passes its hooks (3.6: empty chains) and the metadata it builds for them; with no hook set, the
    # stub calls none where they are None
    hooks = [h for h in _hooks() if h is not None]
    if not all(_empty_hook(h) for h in hooks):
        return None
    head_args = [None if any(a is h for h in hooks) or type(a).__name__ == "LazyDict" else a
                 for a in args[5:len(args) - n]]
    try:
        head = [_encode(a) for a in head_args]
        layout = [f.what if isinstance(f, _Mark) else {"const": _encode(f)} for f in full]
    except ValueError:
        return None
    cubin = next((Path(p).name for p in c.metadata_group.values() if str(p).endswith(".cubin")), None)
    if cubin is None:
        return None
    return {"version": RECORD_VERSION, "name": c.name, "cubin": cubin, "shared": int(md.shared),
            "num_warps": int(md.num_warps), "head": head, "layout": layout,
            "stub_file": stub_file, "utils_file": utils.__file__}


def keep(kernels: dict[str, LoadedKernel], root: Path, triton_version: str) -> int:
    """Capture and store the direct record of each kernel (cache key -> kernel) that has none on this machine;
    the number stored. Best effort: a kernel that cannot be captured keeps Triton's path."""
    stored = 0
    shas: dict[str, str] = {}  # C module file -> its content hash (one stub serves many kernels)
    for key, k in kernels.items():
        path = _record_path(root, triton_version, key)
        if path.is_file():
            continue
        try:
            rec = capture(k)
            if rec is None:
                continue
            # the C modules, content-addressed (kernels alike in signature share a stub)
            for field in ("stub_file", "utils_file"):
                file = rec.pop(field)
                if file not in shas:
                    data = Path(file).read_bytes()
                    shas[file] = hashlib.sha256(data).hexdigest()
                    target = _module_path(root, triton_version, shas[file])
                    if not target.is_file():
                        cache.atomic_write_bytes(target, data)
                rec[field.replace("_file", "")] = shas[file]
            cache.atomic_write_text(path, json.dumps(rec, sort_keys=True))  # last: the record says it is whole
            stored += 1
        except Exception:  # noqa: BLE001 - an optimisation: the kernel launches through Triton as before
            continue
    return stored


# ------------------------------------------------------------------------------------------------ launch

_FUNCTIONS: dict[tuple[str, str, str], Any] = {}
_FUNCTIONS_LOCK = threading.Lock()


class _StandIn(types.ModuleType):
    """Stands in for ``triton`` and ``triton.backends.nvidia.driver`` while a kept launch stub initialises: some
    releases' stubs import the driver module at load for the one type they pass tensor descriptors as (TMA; no
    direct record has one), and Python's import of a dotted name from C imports its top package too, which
    would import all of Triton."""

    class PyCUtensorMap:  # never instantiated: only kernels without tensor descriptors launch directly
        pass


def _function(path: Path, module_name: str, function: str) -> Any:
    """A C function of a kept C module, loaded once per process. Taken at load: a later load of a same-named
    extension module (Triton's own) overwrites the attributes of the module object Python registered last.
    The module's registration under its name is undone, so Triton's loads see what they would without it."""
    key = (str(path), module_name, function)
    with _FUNCTIONS_LOCK:
        fn = _FUNCTIONS.get(key)
        if fn is not None:
            return fn
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as {module_name}")
        stand_ins = ("triton", "triton.backends.nvidia.driver")
        _imp.acquire_lock()  # no other thread imports while the stand-ins are registered
        try:
            before = {n: sys.modules.get(n) for n in (module_name, *stand_ins)}
            if before["triton"] is None:  # (a loaded Triton is used as it is)
                sys.modules.update({n: _StandIn(n) for n in stand_ins if before[n] is None})
            try:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                fn = getattr(module, function)
            finally:
                for n, m in before.items():
                    if m is None:
                        sys.modules.pop(n, None)
                    else:
                        sys.modules[n] = m
        finally:
            _imp.release_lock()
        _FUNCTIONS[key] = fn
        return fn


class KernelMetadata:
    """What the runtime reads of a compiled kernel's metadata (Triton's own is a namedtuple of many fields)."""

    def __init__(self, name: str, num_warps: int, shared: int) -> None:
        self.name, self.num_warps, self.shared = name, num_warps, shared


def _current_stream() -> Callable[[], tuple[int, int]]:
    """(device index, raw stream) of the current CUDA device, as Triton's launch takes them (torch's current
    stream of the current device)."""
    import torch

    current_device, raw_stream = torch.cuda.current_device, torch._C._cuda_getCurrentRawStream

    def get() -> tuple[int, int]:
        d = current_device()
        return d, raw_stream(d)

    return get


class DirectKernel:
    """A built kernel launched from its direct record: ``kernel[grid](*runtime_args, stream=None)``, as
    ``launch.LoadedKernel``. Its binary is loaded on a device at its first launch there (one function handle
    per device)."""

    def __init__(self, record: dict[str, Any], cubin: Path, stub: Path, utils: Path) -> None:
        self.name: str = record["name"]
        self.metadata = KernelMetadata(self.name, record["num_warps"], record["shared"])
        self._cubin, self._stub, self._utils = cubin, stub, utils
        self._head = tuple(_decode(h) for h in record["head"])
        layout = record["layout"]
        self.n_runtime = sum(1 for f in layout if not isinstance(f, dict))
        # the launcher's argument list: the run-time arguments in order, constants at their places
        self._plain = [f for f in layout if not isinstance(f, dict)] == list(range(len(layout)))
        self._template = [_decode(f["const"]) if isinstance(f, dict) else None for f in layout]
        self._places = [i for i, f in enumerate(layout) if not isinstance(f, dict)]
        self._functions: dict[int, int] = {}
        self._resources: dict[str, int] = {}
        self._launch: Callable[..., Any] | None = None
        self._stream: Callable[[], tuple[int, int]] | None = None
        self._lock = threading.Lock()

    def _function(self, device: int) -> int:
        with self._lock:
            fn = self._functions.get(device)
            if fn is None:
                load_binary = _function(self._utils, _UTILS_NAME, "load_binary")
                loaded = load_binary(self.name, self._cubin.read_bytes(), self.metadata.shared, device)
                fn = loaded[1]
                self._resources = {"n_regs": loaded[2], "n_spills": loaded[3]}
                if len(loaded) > 4 and self.metadata.num_warps * 32 > loaded[4]:
                    raise RuntimeError(f"{self.name}: {self.metadata.num_warps} warps need "
                                       f"{self.metadata.num_warps * 32} threads, the device allows {loaded[4]}")
                self._functions[device] = fn
            return fn

    def _prepare(self) -> None:
        self._launch = _function(self._stub, _STUB_NAME, "launch")
        self._stream = _current_stream()

    def resources(self) -> dict[str, Any]:
        """Registers per thread and spilled bytes of the binary (loads it on the current device)."""
        if self._stream is None:
            self._prepare()
        assert self._stream is not None
        self._function(self._stream()[0])
        return dict(self._resources)

    def launcher_args(self, args: Sequence[Any]) -> list[Any]:
        if self._plain:
            return list(args)
        full = list(self._template)
        for place, a in zip(self._places, args):
            full[place] = a
        return full

    def __getitem__(self, grid: int | Sequence[int]) -> Callable[..., None]:
        g = (grid,) if isinstance(grid, int) else tuple(grid)
        gx, gy, gz = (g + (1, 1, 1))[:3]
        if self._launch is None:
            self._prepare()
        launch, current, head, n = self._launch, self._stream, self._head, self.n_runtime
        assert launch is not None and current is not None

        def run(*args: Any, stream: Any = None) -> None:
            if len(args) != n:
                raise TypeError(f"{self.name} takes {n} runtime arguments, got {len(args)}")
            device, raw = current()
            fn = self._functions.get(device) or self._function(device)
            launch(gx, gy, gz, raw if stream is None else stream, fn, *head, *self.launcher_args(args))

        return run


def load(key: str, entry: Path, root: Path, triton_version: str) -> DirectKernel | None:
    """The kernel of cache entry ``key`` (its folder ``entry``) launched from its direct record on this machine,
    or None where it has none (or a part of it is gone)."""
    try:
        rec = json.loads(_record_path(root, triton_version, key).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("version") != RECORD_VERSION:
        return None
    cubin = Path(entry) / rec["cubin"]
    stub, utils = _module_path(root, triton_version, rec["stub"]), _module_path(root, triton_version, rec["utils"])
    if not (cubin.is_file() and stub.is_file() and utils.is_file()):
        return None
    return DirectKernel(rec, cubin, stub, utils)


def _hooks() -> list[Any]:
    """The launch hooks of a loaded Triton (none where it is not loaded)."""
    knobs = sys.modules.get("triton.knobs")
    holder = getattr(knobs, "runtime", None)
    if holder is None:  # releases before knobs keep them on the compiled-kernel class
        holder = getattr(sys.modules.get("triton.compiler.compiler"), "CompiledKernel", None)
    return [getattr(holder, n, None) for n in ("launch_enter_hook", "launch_exit_hook")]


def _empty_hook(hook: Any) -> bool:
    """None, or a chain of hooks with none in it (3.6's default: HookChain)."""
    return hook is None or getattr(hook, "calls", None) == []


def hooks_set() -> bool:
    """Whether a loaded Triton has launch hooks set (a profiler's): launches then go through Triton, which
    calls them. A hook set after a kernel set was loaded is not called by its direct launches."""
    return not all(_empty_hook(h) for h in _hooks())

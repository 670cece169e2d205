"""Launchable kernels rebuilt from the files an AOT compile wrote (no recompile)."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from .triton_source import make_source

# what a launch reads of a compiled kernel: its metadata and its binary. Triton's CompiledKernel reads every file
# it is given, and the intermediate forms (ttir, ttgir, llir, ptx, the source: ~85% of an entry's bytes) are for
# the build's checks and for people, not for launching.
LAUNCH_EXTS = ("json", "cubin")


def launch_record(fn: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any],
                  launch: Mapping[str, Any]) -> dict[str, Any]:
    """What launching kernel ``fn`` as compiled needs besides its binary, as JSON (ordered pairs: a cache entry's
    metadata is written with sorted keys): its function name, argument names, run-time signature, constexprs and
    launch options. The build stores it in the kernel's cache entry; ``RecordedKernel`` reads it back."""
    from .triton_source import _arg_names

    return {"name": fn.__name__, "args": _arg_names(fn), "signature": [[n, t] for n, t in signature.items()],
            "constexprs": [[n, v] for n, v in constexprs.items()], "launch": dict(launch)}


class RecordedKernel:
    """A kernel's ``launch_record`` standing in for its ``@jit`` function where the kernel is only launched, never
    compiled: Triton's launch path reads the function's name, its argument names and (3.1/3.2) the indices of
    its constexpr arguments. Loading a package's kernels from records skips importing the rendered source,
    whose ``@jit`` decorators read each function's source back with ``inspect`` (most of a variant's load)."""

    launch_metadata = None  # a @jit function's launch-metadata hook: Triton calls it only where one is set

    def __init__(self, record: Mapping[str, Any]) -> None:
        self.__name__: str = record["name"]
        self.arg_names: list[str] = list(record["args"])
        constant = {n for n, _ in record["constexprs"]}
        self.constexprs: list[int] = [i for i, n in enumerate(self.arg_names) if n in constant]
        self.signature: dict[str, str] = {n: t for n, t in record["signature"]}
        self.constants: dict[str, Any] = {n: v for n, v in record["constexprs"]}
        self.launch: dict[str, Any] = dict(record["launch"])


class LaunchTables:
    """A rendered unit's tables as its module declares them (CONSTEXPRS, SIGNATURES, LAUNCH per kernel, and
    OPTIONS), rebuilt from its kernels' launch records: what the runtime's kernel set reads of the module."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.OPTIONS: dict[str, Any] = dict(options)
        self.CONSTEXPRS: dict[str, dict[str, Any]] = {}
        self.SIGNATURES: dict[str, dict[str, str]] = {}
        self.LAUNCH: dict[str, dict[str, Any]] = {}

    def add(self, name: str, fn: RecordedKernel) -> None:
        self.CONSTEXPRS[name], self.SIGNATURES[name], self.LAUNCH[name] = fn.constants, fn.signature, fn.launch


def _current_device() -> int:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else 0


class LoadedKernel:
    """A launchable kernel rebuilt from persisted files: ``kernel[grid](*runtime_args, stream=None)``, on the
    current device. Triton's CompiledKernel loads its module on the device current at its first launch and
    keeps it there; a kernel set serves every device of its arch (a model split over GPUs in one process), so
    each further device gets a copy of it that loads its own."""

    def __init__(self, compiled: Any, order: list[tuple[str, bool]], constexprs: Mapping[str, Any]) -> None:
        self.compiled = compiled  # triton CompiledKernel (internal API: don't reach into it elsewhere)
        # (name, is_constexpr) for each argument the launcher parses, in launcher order
        self._order = order
        self._constexprs = dict(constexprs)
        self.n_runtime = sum(1 for _, c in order if not c)
        self._by_device: dict[int, Any] = {}
        self._lock = threading.Lock()

    def on_device(self, device: int) -> Any:
        """The CompiledKernel that launches on ``device``: the first device's is ``compiled`` itself."""
        found = self._by_device.get(device)
        if found is not None:
            return found
        with self._lock:
            if device not in self._by_device:
                if not self._by_device:
                    self._by_device[device] = self.compiled
                else:
                    other = copy.copy(self.compiled)
                    other.module = other.function = None  # loaded again, on this device, at its first launch
                    self._by_device[device] = other
            return self._by_device[device]

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
        launch = self.on_device(_current_device())[g]
        n = self.n_runtime

        def run(*args: Any, stream: Any = None) -> None:
            if len(args) != n:
                raise TypeError(f"{self.compiled.name} takes {n} runtime arguments, got {len(args)}")
            launch(*self.launcher_args(args), stream=stream)

        return run

    def launcher_args(self, args: Sequence[Any]) -> list[Any]:
        """The run-time arguments ``args`` as the launcher takes them: the launcher's arity follows
        src.signature, which has constexpr slots only from Triton 3.3 on."""
        it = iter(args)
        return [self._constexprs[name] if is_c else next(it) for name, is_c in self._order]


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
    group = {f"{stem}.{ext}": str(files_dir / f"{stem}.{ext}") for ext in LAUNCH_EXTS}
    missing = [name for name, path in group.items() if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"{files_dir}: need {stem}.json and {stem}.cubin (missing: {', '.join(missing)})")
    # (CompiledKernel takes the first *.json it meets as its metadata: the json comes first)
    compiled = CompiledKernel(src, group, hash)
    order = [(name, ty == "constexpr") for name, ty in src.signature.items()]
    return LoadedKernel(compiled, order, constexprs)

"""Ahead-of-time compiles of one kernel with the installed Triton (no GPU needed): Triton's cache-group
files and a json-able summary."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from .interpreter_repair import repair_triton_language
from .triton_source import make_source
from .triton_versions import TargetUnsupported, can_target

# File name extensions Triton writes into its cache group for one CUDA kernel.
_ARTIFACT_EXTS = ("json", "cubin", "ptx", "llir", "ttgir", "ttir", "source")


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


def _check_compilable(fn: Any) -> None:
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        hint = (" (it was defined while TRITON_INTERPRET=1: import its module inside "
                "interpreter_repair.without_interpreter())" if type(fn).__name__ == "InterpretedFunction" else "")
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

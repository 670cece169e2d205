"""Triton's interpreter (TRITON_INTERPRET=1) against AOT compiles in one process: kernel modules imported
outside it, and ``triton.language`` put back after the interpreter left it patched."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator


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

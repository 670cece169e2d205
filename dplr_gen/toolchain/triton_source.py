"""``ASTSource`` construction for each Triton release's compiler API (Triton 3.1 to 3.9).

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

import inspect
from typing import Any, Iterable, Mapping


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

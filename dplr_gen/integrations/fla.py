"""Route fla's RWKV-7 layers (flash-linear-attention's ``RWKV7Attention``, in ``RWKV7ForCausalLM`` and friends) to
dplr-gen's kernels, with fla's models and code otherwise unchanged::

    import dplr_gen.integrations.fla as dplr_fla

    dplr_fla.enable()                 # from now on, in every thread; dplr_fla.disable() puts fla's back
    with dplr_fla.enabled():          # or for a block: fla's kernels are back when the last open block exits
        loss = model(input_ids, labels=input_ids).loss

What it patches (fla 0.6): fla's layer calls two functions, looked up in its module's namespace at every call:
``chunk_rwkv7`` (training, and prefills of 64 tokens or more) and ``fused_mul_recurrent_rwkv7`` (shorter calls
without gradient: decoding). The switch rebinds those two names in ``fla.layers.rwkv7`` and in every other loaded
``fla.*`` module that holds fla's same function objects by name (the re-exporting packages ``fla.ops.rwkv7`` and
``fla.ops``: code that imports them from there while the switch is on gets dplr-gen's) to
``dplr_gen.chunk_rwkv7`` / ``dplr_gen.fused_mul_recurrent_rwkv7``, which take fla's arguments as the layer passes
them. The modules that define them (``fla.ops.rwkv7.chunk``, ``fla.ops.rwkv7.fused_recurrent``) keep fla's
functions, so fla's own code and tests can still reach fla's kernels. Turning it off puts fla's functions back
wherever one of the two ops is still bound in a ``fla.*`` module (names another patch replaced since are left
alone). Code outside fla that bound fla's functions by name before the switch keeps them: route such code itself.

Process-wide, as the layer's lookup is: one thread's ``enabled()`` block routes every thread's layers until the
last open block exits (blocks count; ``enable()`` holds it on until ``disable()``, which ends it at once, open
blocks included). Calls already running finish with the function they started with; a graph torch.compile
traced calls the function it traced until it is traced again (turn the switch on before compiling). fla itself is
imported only when the switch is turned on; without it that raises an ImportError naming the package to install.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from typing import Any, Callable, Iterator

# the functions fla's RWKV-7 layer calls, and the module whose namespace its forward looks them up in
OPS = ("chunk_rwkv7", "fused_mul_recurrent_rwkv7")
LAYER_MODULE = "fla.layers.rwkv7"
INSTALL = "pip install flash-linear-attention (fla's layers and models; it brings fla-core, fla's kernels)"

_lock = threading.RLock()
_explicit = False  # enable() called, and no disable() since
_holders = 0  # enabled() blocks open, in any thread
_routed: dict[str, Any] = {}  # op name -> what the switch binds (one object per name while on)
_originals: dict[str, Any] = {}  # op name -> fla's function, as the layer held it when the switch turned on


def _import_layer() -> Any:
    """fla's RWKV-7 layer module, or an ImportError that says what to install."""
    try:
        return importlib.import_module(LAYER_MODULE)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing == "fla" or missing.startswith("fla."):
            raise ImportError(f"dplr_gen.integrations.fla routes fla's RWKV-7 layer ({LAYER_MODULE}), which is not "
                              f"installed: {INSTALL}") from e
        raise ImportError(f"{LAYER_MODULE} is installed but failed to import ({e}); it needs fla's dependencies "
                          f"(transformers, einops): {INSTALL}") from e


def _fla_modules() -> list[Any]:
    """The loaded modules of the fla package (a snapshot: importing may add modules while we look)."""
    return [m for n, m in list(sys.modules.items()) if m is not None and (n == "fla" or n.startswith("fla."))]


def _default_ops() -> dict[str, Any]:
    import dplr_gen

    return {name: getattr(dplr_gen, name) for name in OPS}


def _bind(targets: dict[str, Any]) -> None:
    """Bind ``targets`` (op name -> function) wherever a fla module holds fla's function or the switch's."""
    for module in _fla_modules():
        for name in OPS:
            if name not in vars(module):
                continue
            held = vars(module)[name]
            ours = held is _routed.get(name)
            if not ours and held is not _originals.get(name):
                continue  # another object of that name: not the layer's function
            if not ours and getattr(held, "__module__", None) == module.__name__:
                continue  # the module that defines fla's function keeps it (fla's own code and tests use it)
            setattr(module, name, targets[name])


def _turn_on(ops: dict[str, Any]) -> None:
    layer = _import_layer()
    if not _routed:  # off -> on: fla's functions as its layer holds them
        missing = [n for n in OPS if not callable(getattr(layer, n, None))]
        if missing:
            raise RuntimeError(f"{LAYER_MODULE} binds no {', '.join(missing)}: this fla version's layer does not "
                               "call the functions the switch routes (it knows fla 0.6's layout)")
        _originals.update({n: getattr(layer, n) for n in OPS})
    _bind(ops)
    _routed.clear()
    _routed.update(ops)


def _turn_off() -> None:
    if _routed:
        _bind(_originals)
    _routed.clear()
    _originals.clear()


def _check_op(name: str, fn: Any) -> Any:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a callable taking fla's arguments (or None for dplr_gen.{name}), got "
                        f"{type(fn).__name__}")
    return fn


def enable(*, chunk_rwkv7: Callable[..., Any] | None = None,
           fused_mul_recurrent_rwkv7: Callable[..., Any] | None = None) -> None:
    """Route fla's RWKV-7 layers to dplr-gen until :func:`disable` (idempotent). The ops default to
    ``dplr_gen.chunk_rwkv7`` and ``dplr_gen.fused_mul_recurrent_rwkv7`` (the built package that covers the inputs'
    GPU); pass others taking the same arguments, e.g. ``generated.hopper``'s to pin a package. Raises an
    ImportError naming the package to install where fla is not installed."""
    global _explicit
    given = {"chunk_rwkv7": _check_op("chunk_rwkv7", chunk_rwkv7),
             "fused_mul_recurrent_rwkv7": _check_op("fused_mul_recurrent_rwkv7", fused_mul_recurrent_rwkv7)}
    with _lock:
        defaults = _default_ops() if None in given.values() else {}
        _turn_on({n: given[n] if given[n] is not None else defaults[n] for n in OPS})
        _explicit = True


def disable() -> None:
    """Put fla's own functions back, now (idempotent; also ends open :func:`enabled` blocks' routing)."""
    global _explicit, _holders
    with _lock:
        _explicit, _holders = False, 0
        _turn_off()


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Route fla's RWKV-7 layers to dplr-gen's default ops inside the block: on when the first open block enters
    (unless already on), off again when the last exits, unless :func:`enable` holds it on."""
    global _holders
    with _lock:
        if not _routed:
            _turn_on(_default_ops())
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            if _holders > 0:  # 0 when disable() ended the routing inside the block
                _holders -= 1
                if _holders == 0 and not _explicit:
                    _turn_off()


def is_enabled() -> bool:
    """Whether fla's RWKV-7 layers are routed to dplr-gen now."""
    with _lock:
        return bool(_routed)


def routes() -> dict[str, str]:
    """What each loaded fla module binds under the two names now: {"module.name": repr of the function} (the
    switch's ops where it routes them; empty where fla is not loaded). For logs and checks."""
    with _lock:
        return {f"{m.__name__}.{n}": repr(vars(m)[n]) for m in _fla_modules() for n in OPS if n in vars(m)}

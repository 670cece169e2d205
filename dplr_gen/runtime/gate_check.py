"""The ``lower_bound`` promise (gk >= lower_bound everywhere), checked.

A variant built for a gate bound factors its exponents on that promise (it clamps its gates at its built
bound); gates below it give finite, wrong results. So a call with ``lower_bound`` checks gk >= lower_bound:

* on a GPU, where the call runs a bounded chunk variant: inside the forward's prep kernel, which loads every
  gate anyway. A program that loads a gate below the caller's lower_bound (or a NaN) stores 0 into a
  one-element "promise kept" flag (``Promise``), and an asynchronous device assert (``torch._assert_async``)
  on the flag is queued after the prep: no reduction over gk and no host sync. A broken promise surfaces at
  the next synchronisation as "CUDA error: device-side assert triggered", after which the CUDA context is
  unusable (a device assert cannot be recovered from), which is also why the flag is never reset; rerun with
  ``DPLR_GEN_CHECK_LOWER_BOUND=sync`` for the exact message;
* on a GPU otherwise (a variant for any gate chosen, the fused recurrent op, context parallelism): the same
  assert after a min reduction over gk;
* on CPU tensors (the interpreter), or with ``DPLR_GEN_CHECK_LOWER_BOUND=sync``: on the host, a ValueError
  naming lower_bound and the offending minimum;
* ``DPLR_GEN_CHECK_LOWER_BOUND=0`` skips the check (benchmarks/lower_bound_check.py measures its cost).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from ..toolchain import settings
from .devices import cuda_index

CHECK_ENV = "DPLR_GEN_CHECK_LOWER_BOUND"

# tests: the in-kernel form on CPU tensors too (the assert then raises at once), where it would check on the host
KERNEL_ON_CPU = False


class Promise(NamedTuple):
    """What a bounded variant's prep checks: the caller's ``lower_bound`` (the variant clamps at its built
    bound, which may lie below it) and ``kept``, int32 [1], which a program that loads a gate below it (or a NaN)
    sets to 0."""

    lower_bound: float
    kept: torch.Tensor


def _mode() -> str:
    """"off", "sync" or "device" (the default), from CHECK_ENV; another value is a SettingError naming it (a typo
    must not leave the check in a mode nobody chose)."""
    value = os.environ.get(CHECK_ENV, "1")
    mode = settings.CHECK_MODES.get(value)
    if mode is None:
        raise settings.invalid(CHECK_ENV, value)
    return mode


def _broken(lower_bound: float, minimum: str) -> str:
    return (
        f"lower_bound={lower_bound} promises gk >= {lower_bound} everywhere, but min(gk) = {minimum}: the variant "
        f"built for that bound would return wrong numbers. Pass lower_bound=None (any gate) or a bound at or "
        f"below the gates' minimum; {CHECK_ENV}=0 skips this check"
    )


def check_lower_bound(gk: torch.Tensor, lower_bound: float, in_kernel: bool = False) -> float | None:
    """Raise (or queue a device assert) unless every gk >= lower_bound; NaN gates break the promise too.
    ``in_kernel``: the call runs a bounded chunk variant, whose forward prep can check the promise itself. Returns
    the bound the kernels are to check (then pass ``promise_for(gk, it)`` to the forward), or None where it was
    checked here or is not checked."""
    mode = _mode()
    if mode == "off":
        return None
    host = gk.device.type == "cpu" and not KERNEL_ON_CPU
    if not torch.compiler.is_compiling() and (host or mode == "sync"):
        minimum = gk.min()
        if not bool(minimum >= lower_bound):
            raise ValueError(_broken(lower_bound, f"{minimum.item():.6g}"))
        return None
    if in_kernel:
        return float(lower_bound)
    # in a compiled graph too: the assert is a graph node
    _assert_min(gk, lower_bound)
    return None


def _assert_min(gk: torch.Tensor, lower_bound: float) -> None:
    torch._assert_async(gk.min() >= lower_bound, device_message(lower_bound))


def promise_for(gk: torch.Tensor, lower_bound: float | None) -> Promise | None:
    """The promise a bounded variant's forward prep checks (``lower_bound`` from check_lower_bound), with the
    device's flag; None for no check. Where no flag can be made now (its first use falls inside a CUDA graph
    capture, whose allocations and fills only happen at replay) the min-reduction assert is queued instead."""
    if lower_bound is None:
        return None
    flag = kernel_flag(gk.device)
    if flag is None:
        _assert_min(gk, lower_bound)
        return None
    return Promise(float(lower_bound), flag)


def kernel_flag(device: torch.device) -> torch.Tensor | None:
    """The "promise kept" flag for ``device``, int32 [1], 1 until a prep finds a broken promise. CUDA: one
    persistent buffer per device (a broken promise ends the CUDA context, so it never needs resetting), or None
    where it does not exist yet and a CUDA graph is being captured; elsewhere a fresh one each call (there the
    assert raises at once and the process goes on)."""
    if device.type != "cuda":
        return torch.ones((1,), dtype=torch.int32, device=device)
    index = cuda_index(device)
    flag = _CUDA_FLAGS.get(index)
    if flag is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        flag = _CUDA_FLAGS.setdefault(index, torch.ones((1,), dtype=torch.int32, device=torch.device("cuda", index)))
    return flag


# device index -> its "promise kept" flag
_CUDA_FLAGS: dict[int, torch.Tensor] = {}


@functools.lru_cache(maxsize=None)
def scratch_flag(device: torch.device) -> torch.Tensor:
    """A flag nobody reads, for the bounded preps that check nothing (the backward's, the check switched off)."""
    return torch.ones((1,), dtype=torch.int32, device=device)


def confirm(promise: Promise) -> None:
    """Queue the device assert on the flag, after the prep that checked the promise (on CPU: raises now)."""
    torch._assert_async(promise.kept, device_message(promise.lower_bound))


def device_message(lower_bound: float) -> str:
    """The device assert's message: CUDA keeps at most 254 characters, so it names the broken promise and how
    to get the full error."""
    return f"dplr_gen: gk < lower_bound={lower_bound:.6g} (or NaN); rerun with {CHECK_ENV}=sync for details"

"""The ``lower_bound`` promise (gk >= lower_bound everywhere), checked.

A variant built for a gate bound factors its exponents on that promise; gates below it give finite, wrong
results. So a call with ``lower_bound`` checks min(gk) >= lower_bound:

* on a GPU, without a host sync: an asynchronous device assert (``torch._assert_async``) queued after a
  min reduction over gk. A broken promise surfaces at the next synchronisation as "CUDA error: device-side
  assert triggered", after which the CUDA context is unusable (a device assert cannot be recovered from);
  rerun with ``DPLR_GEN_CHECK_LOWER_BOUND=sync`` for the exact message;
* on CPU tensors (the interpreter), or with ``DPLR_GEN_CHECK_LOWER_BOUND=sync``: on the host, a ValueError
  naming lower_bound and the offending minimum;
* ``DPLR_GEN_CHECK_LOWER_BOUND=0`` skips the check (one reduction over gk per call;
  benchmarks/lower_bound_check.py measures its cost).
"""

from __future__ import annotations

import os

import torch

CHECK_ENV = "DPLR_GEN_CHECK_LOWER_BOUND"


def _broken(lower_bound: float, minimum: str) -> str:
    return (
        f"lower_bound={lower_bound} promises gk >= {lower_bound} everywhere, but min(gk) = {minimum}: the variant "
        f"built for that bound would return wrong numbers. Pass lower_bound=None (any gate) or a bound at or "
        f"below the gates' minimum; {CHECK_ENV}=0 skips this check"
    )


def check_lower_bound(gk: torch.Tensor, lower_bound: float) -> None:
    """Raise (or queue a device assert) unless every gk >= lower_bound; NaN gates break the promise too."""
    mode = os.environ.get(CHECK_ENV, "1")
    if mode in ("", "0"):
        return
    minimum = gk.min()
    if not torch.compiler.is_compiling() and (gk.device.type == "cpu" or mode == "sync"):
        if not bool(minimum >= lower_bound):
            raise ValueError(_broken(lower_bound, f"{minimum.item():.6g}"))
        return
    # in a compiled graph too: the assert is a graph node
    torch._assert_async(minimum >= lower_bound, device_message(lower_bound))


def device_message(lower_bound: float) -> str:
    """The device assert's message: CUDA keeps at most 254 characters, so it names the broken promise and how
    to get the full error."""
    return f"dplr_gen: gk < lower_bound={lower_bound:.6g} (or NaN); rerun with {CHECK_ENV}=sync for details"

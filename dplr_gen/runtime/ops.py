"""The user-facing ops, with fla-core's names, argument order and defaults.

Each call validates its arguments (errors name the argument), picks a built variant of the package, and runs
torch.library custom ops (opaque to torch.compile, with fake implementations, so fullgraph works) whose
autograd formula is the generated backward. The backward recomputes the forward's chunk states (and U)
instead of keeping them alive between the passes, unless ``disable_recompute=True`` (in eager mode the forward
then also runs the backward's prep for it: see _EagerOp).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import TYPE_CHECKING, Any, Optional

import torch

from . import fused_recurrent_driver
from . import gate_check
from . import varlen
from ..plan.variant import HEAD_DIM_MAX, HEAD_DIM_MIN

if TYPE_CHECKING:
    from .loader import SpecPackage

# benchmarks (A/B): False keeps a forward that keeps the states from running the backward's prep (_EagerOp)
PREP_IN_FORWARD = True

OP_NAMES = ("chunk_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_dplr_delta_rule", "fused_recurrent_rwkv7",
            "fused_mul_recurrent_rwkv7")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TORCH_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}


# ----------------------------------------------------------------------------------------------------------
# argument checks: every message names the argument and what would be valid


def _tensors_agree(tensors: tuple[Any, ...]) -> bool:
    """The common case of the input checks, in few attribute reads (a decode step's host time is mostly checks
    like these): six tensors, q, k, a, b, gk of one 4-D shape with T > 0 and head dims in range, v matching
    them, one device and q's dtype (gk's may be float32)."""
    q, k, v, a, b, g = tensors
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    shape, dt, dev = q.shape, q.dtype, q.get_device()
    vs = v.shape
    # (get_device() is -1 for every device but CUDA's: CPU tensors take the named checks)
    return (dev >= 0 and len(shape) == 4 and shape[1] > 0 and k.shape == shape and a.shape == shape and b.shape == shape
            and g.shape == shape and len(vs) == 4 and vs[:3] == shape[:3] and dt in DTYPE_NAMES
            and k.dtype == dt and v.dtype == dt and a.dtype == dt and b.dtype == dt
            and (g.dtype == dt or g.dtype == torch.float32)
            and HEAD_DIM_MIN <= shape[3] <= HEAD_DIM_MAX and HEAD_DIM_MIN <= vs[3] <= HEAD_DIM_MAX
            and k.get_device() == dev and v.get_device() == dev and a.get_device() == dev
            and b.get_device() == dev and g.get_device() == dev)


def _check_tensors(names: tuple[str, ...], tensors: tuple[Any, ...]
                   ) -> tuple[int, int, int, int, int, torch.device]:
    """The input tensors checked one property at a time, each failure named: (B, T, H, K, V, device)."""
    q_name, k_name, v_name, a_name, b_name, g_name = names
    for n, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    q, k, v, a, b, g = tensors
    if q.dim() != 4:
        raise ValueError(f"{q_name} must be [B, T, H, K] (4 dims), got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for n, t in ((k_name, k), (a_name, a), (b_name, b), (g_name, g)):
        if tuple(t.shape) != (B, T, H, K):
            raise ValueError(f"{n} must have the shape of {q_name} {(B, T, H, K)}, got {tuple(t.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"{v_name} must be [B, T, H, V] with B, T, H = {(B, T, H)}, got {tuple(v.shape)}")
    V = v.shape[3]
    for n, dim, d in ((q_name, "K", K), (v_name, "V", V)):
        if not HEAD_DIM_MIN <= d <= HEAD_DIM_MAX:
            raise ValueError(f"{n} has head dim {dim} = {d} (its last dim); valid: {HEAD_DIM_MIN} to {HEAD_DIM_MAX}")
    if T == 0:
        raise ValueError(f"{q_name} has T = 0 tokens; at least one is needed")
    dev = q.device
    for n, t in zip(names, tensors):
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device} but {q_name} is on {dev}: all inputs must be on one device")
    dt = q.dtype
    if dt not in DTYPE_NAMES:
        raise TypeError(f"{q_name} has dtype {dt}; supported: bfloat16, float16, float32")
    for n, t in zip(names[1:5], tensors[1:5]):
        if t.dtype != dt:
            raise TypeError(f"{n} has dtype {t.dtype} but {q_name} has {dt}: {', '.join(names[:5])} must share one")
    if g.dtype not in (dt, torch.float32):
        raise TypeError(f"{g_name} has dtype {g.dtype}; it must be {dt} (like {q_name}) or float32")
    return B, T, H, K, V, dev


def _check_inputs(
    names: tuple[str, ...],
    tensors: tuple[Any, ...],
    scale: Any,
    initial_state: Any,
    cu_seqlens: Any,
    cu_seqlens_cpu: Any,
) -> dict[str, Any]:
    if _tensors_agree(tensors):
        B, T, H, K = tensors[0].shape
        V = tensors[2].shape[3]
        dev = tensors[0].device
    else:
        B, T, H, K, V, dev = _check_tensors(names, tensors)
    if scale is None:
        scale = K**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None (meaning K**-0.5), got {scale!r}")
    q_name = names[0]

    offsets: tuple[int, ...] | None = None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            got = cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
            raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {got}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries [0, ..., T], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != dev:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {q_name} is on {dev}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences laid end to end), got B = {B}")
        # read once per tensor object (none while tracing: checked in eager runs)
        offsets = varlen.read_offsets(cu_seqlens, cu_seqlens_cpu, T)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a tensor [N, H, K, V] or None, got {type(initial_state).__name__}")
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state must be [N, H, K, V] = {(N, H, K, V)} (N = {'number of sequences' if cu_seqlens is not None else 'B'}), "
                f"got {tuple(initial_state.shape)}"
            )
        if not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a floating tensor, got {initial_state.dtype}")
        if initial_state.device != dev:
            raise ValueError(f"initial_state is on {initial_state.device} but {q_name} is on {dev}")
    return {"B": B, "T": T, "H": H, "K": K, "V": V, "N": N, "scale": float(scale), "offsets": offsets}


def _constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result``, without importing torch._dynamo at import time.

    The public decorator imports torch._dynamo (and sympy): 1.1 s here, 5 s on the H100 machine, a third of a
    cold start (scripts/cold_start.py). It only sets a marker that Dynamo reads when it traces, so when Dynamo
    is not loaded yet the marker is set directly (tests/test_torch_compile.py fails if Dynamo stops reading it).
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_constant_result  # depends only on static facts: the package folder, dtypes, shapes
def _select(
    pkg_dir: str, op: str, dtype: torch.dtype, K: int, V: int, varlen: bool,
    chunk_size: int | None = None, lower_bound: float | None = None, gate_dtype: torch.dtype | None = None,
) -> str:
    """The best built variant that honours the request exactly; otherwise one generated on demand from the
    package's spec (dplr_gen.runtime.ondemand; with DPLR_GEN_NO_JIT=1 a ValueError naming the spec entry to add).
    ``gate_dtype``: the dtype gk arrives in (None: any; an fp32-gate variant is preferred).
    Memoised per request (a package's variants do not change within a process; errors are not kept)."""
    return _select_cached(pkg_dir, op, dtype, K, V, varlen, chunk_size, lower_bound, gate_dtype)


def _gate_fits(variant_gate: str, gate_name: str | None) -> bool:
    """An fp32-gate variant takes gk of any dtype (converted to fp32: exact from bf16/fp16); a variant that
    reads gk in the input dtype takes only gk already in that dtype (converting into it would round)."""
    return variant_gate == "fp32" or variant_gate == gate_name


@functools.cache  # apart from _select: Dynamo reads its constant marker off a plain function
def _select_cached(
    pkg_dir: str, op: str, dtype: torch.dtype, K: int, V: int, varlen: bool,
    chunk_size: int | None, lower_bound: float | None, gate_dtype: torch.dtype | None,
) -> str:
    from .loader import package_at

    package = package_at(pkg_dir)
    dname = DTYPE_NAMES[dtype]
    gname = None if gate_dtype is None else DTYPE_NAMES.get(gate_dtype, str(gate_dtype))
    same = [
        (n, v) for n, v in package.variants.items()
        if v.op == op and v.dtype == dname and v.K == K and v.V == V and v.varlen == varlen
        and _gate_fits(v.gate_dtype, gname)
    ]
    # a variant built for bound L is safe for every gate >= L, so it serves a promise lower_bound >= L
    safe = [(n, v) for n, v in same if v.gate_bound is None or (lower_bound is not None and v.gate_bound <= lower_bound)]
    if not safe:  # generated from the package's spec (or, with DPLR_GEN_NO_JIT=1, an error naming its entry)
        from . import ondemand

        return ondemand.provide(package, op, dname, K, V, varlen, lower_bound, gname)

    def rank(item: tuple[str, Any]) -> tuple[int, int, int, int, str]:
        n, v = item
        return (
            0 if v.gate_bound is not None else 1,  # bounded variants are the fast path
            # gk read as it arrives: no conversion kernel before the forward (and after the backward), fewer
            # bytes in every kernel that loads it; the same results (bf16/fp16 -> fp32 is exact, and dgk is
            # rounded to gk's dtype once either way)
            0 if v.gate_dtype == gname else 1,
            0 if chunk_size is None or v.chunk_size == chunk_size else 1,  # chunk_size only changes rounding
            0 if v.dot_precision in (None, "ieee") else 1,
            n,
        )

    return min(safe, key=rank)[0]


def variant_for(
    package: "SpecPackage", op: str, q: torch.Tensor, v: torch.Tensor, gk: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, chunk_size: int | None = None, lower_bound: float | None = None,
) -> str:
    """The variant the public op runs for these (checked) inputs: q's dtype and head dim, v's head dim, varlen
    or not, gk's dtype, and the keywords."""
    return _select(package.dir_str, op, q.dtype, q.shape[-1], v.shape[-1], cu_seqlens is not None, chunk_size,
                   lower_bound, gk.dtype)


@functools.cache
def _kernels(pkg: str, variant: str, device: torch.device) -> tuple[Any, Any]:
    """(kernel set, variant) for a device, memoised: at small shapes the host work of a call is what the GPU
    waits for (the lookup resolved the device's arch and the package every call)."""
    from .loader import package_at

    package = package_at(pkg)
    return package.kernel_set(variant, package.target_for(device)), package.variants[variant]


# Implementations (plain functions). Two ways reach them:
#   * under torch.compile / export: the torch.library custom ops below (fake implementations, autograd
#     formulas), so graphs hold one opaque node per call and never break;
#   * in eager mode: _EagerOp, a plain autograd.Function. The custom-op dispatcher costs more per call, and
#     its first call imports torch._dynamo (and sympy): 1 s here, 5 s on the H100 machine, most of a cold start.


def _chunk_fwd_run(
    pkg: str, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor, cu_seqlens: Optional[torch.Tensor], scale: float,
    keep_states: bool, prep_for_bwd: bool = False, offsets: Optional[list[int]] = None,
    lower_bound: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(o, final state, then the chunk-start states h and U if ``keep_states``, else two empty tensors, then
    the backward's prep if ``prep_for_bwd``: see chunk_driver.chunk_dplr_fwd; ``offsets``: cu_seqlens as
    read on the host, if it was; ``lower_bound``: the promise the bounded variant's prep checks, from
    gate_check.check_lower_bound)."""
    from . import chunk_driver

    ks, var = _kernels(pkg, variant, q.device)
    o, ht, saved = chunk_driver.chunk_dplr_fwd(ks, var, q, k, v, a, b, gk, scale, h0, cu_seqlens, keep_states,
                                                prep_for_bwd, offsets, gate_check.promise_for(gk, lower_bound))
    h, u = saved["states"] if keep_states else (h0.new_empty(0), v.new_empty(0))
    return o, ht, h, u, saved["prep"]


def _chunk_fwd_impl(
    pkg: str, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor, cu_seqlens: Optional[torch.Tensor], scale: float,
    keep_states: bool, lower_bound: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final state, then the chunk-start states h and U if ``keep_states``, else two empty tensors)."""
    return _chunk_fwd_run(pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale, keep_states,
                          lower_bound=lower_bound)[:4]


def _chunk_bwd_run(
    pkg: str, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor, cu_seqlens: Optional[torch.Tensor], scale: float,
    do: torch.Tensor, dht: Optional[torch.Tensor], h: Optional[torch.Tensor], u: Optional[torch.Tensor],
    prep: Optional[list[Any]] = None, offsets: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of (q, k, v, a, b, gk, h0); the chunk-start states ``h`` and U are recomputed unless given,
    and so is the backward's prep unless ``prep`` holds the forward's run of it. It is taken out of that list
    here, so that only ``saved`` refers to it and the backward frees it before its token pass. ``offsets``:
    cu_seqlens as the forward read it on the host, if it did."""
    from . import chunk_driver

    ks, var = _kernels(pkg, variant, q.device)
    kept = (h, u) if h is not None and h.numel() > 0 and u is not None else None
    saved = chunk_driver.saved_for_backward(ks, var, q, k, v, a, b, gk, h0, kept, scale, cu_seqlens, offsets)
    saved["prep"] = prep.pop() if prep else None
    if offsets is not None:  # the token pass may run a launch per sequence (chunk_driver.per_sequence_launches)
        saved["offsets"], saved["twin"] = offsets, _dense_twin(pkg, variant, q.device)
    return tuple(chunk_driver.chunk_dplr_bwd(ks, var, saved, do.contiguous(), dht))  # type: ignore[return-value]


def _chunk_bwd_impl(
    pkg: str, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor, cu_seqlens: Optional[torch.Tensor], scale: float,
    do: torch.Tensor, dht: Optional[torch.Tensor], h: Optional[torch.Tensor], u: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of (q, k, v, a, b, gk, h0); the chunk-start states ``h`` and U are recomputed unless given."""
    return _chunk_bwd_run(pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale, do, dht, h, u)


def _fused_fwd_impl(
    pkg: str, variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor, cu_seqlens: Optional[torch.Tensor], scale: float,
    state_indices: Optional[torch.Tensor] = None, mul_ab: bool = False, one_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    ks, var = _kernels(pkg, variant, q.device)
    return fused_recurrent_driver.fused_recurrent_dplr_fwd(ks, var, q, k, v, a, b, gk, scale, h0, cu_seqlens,
                                                           state_indices, mul_ab, one_token)


@functools.cache
def _dense_twin(pkg: str, variant: str, device: torch.device) -> Any:
    """The kernel set of varlen ``variant``'s dense twin (the same parameters, dense), where the package has it
    and either its kernels are prebuilt for ``device`` or the interpreter runs (never compiled at run time for
    this); else None. A varlen backward may run its token pass as the twin's, a launch per sequence
    (chunk_driver.per_sequence_launches)."""
    from .loader import interpreting, package_at

    package = package_at(pkg)
    var = package.variants[variant]
    twin = dataclasses.replace(var, varlen=False).name
    if not var.varlen or twin not in package.variants:
        return None
    if not interpreting() and not package.prebuilt(twin, package.target_for(device)):
        return None
    return _kernels(pkg, twin, device)[0]


def _backward_variant(op: str, pkg: str, variant: str) -> str:
    """The chunk variant whose backward serves ``variant``: itself, or for the fused recurrent op the same
    function's gradient through the package's generic-gate chunk backward."""
    if op == "chunk":
        return variant
    from .loader import package_at

    package = package_at(pkg)
    var = package.variants[variant]
    chunk = _select(pkg, "chunk", TORCH_DTYPES[var.dtype], var.K, var.V, var.varlen, gate_dtype=TORCH_DTYPES[var.gate_dtype])
    if package.variants[chunk].gate_dtype != var.gate_dtype:
        raise ValueError(f"backward of {variant} needs a chunk variant with gate dtype {var.gate_dtype}")
    return chunk


# ----------------------------------------------------------------------------------------------------------
# custom ops: what torch.compile sees

_chunk_fwd = torch.library.custom_op("dplr_gen::chunk_fwd", mutates_args=())(_chunk_fwd_impl)
_chunk_bwd = torch.library.custom_op("dplr_gen::chunk_bwd", mutates_args=())(_chunk_bwd_impl)
_fused_fwd = torch.library.custom_op("dplr_gen::fused_recurrent_fwd", mutates_args=())(_fused_fwd_impl)


def _fused_fwd_fake(pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale):  # type: ignore[no-untyped-def]
    return v.new_empty(v.shape), h0.new_empty(h0.shape)


@_chunk_fwd.register_fake
def _(pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale, keep_states, lower_bound=None):  # type: ignore[no-untyped-def]
    from . import chunk_driver

    # the kernel set knows the token pass's chunk, which sizes h
    ks, var = _kernels(pkg, variant, q.device)
    shape = chunk_driver.states_shape(ks, var, q, v.shape[-1], cu_seqlens) if keep_states else (0,)
    u = v.new_empty(v.shape if keep_states else (0,))
    h = h0.new_empty(shape, dtype=chunk_driver.boundary_dtype(q))
    return v.new_empty(v.shape), h0.new_empty(h0.shape), h, u


@_chunk_bwd.register_fake
def _(pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale, do, dht, h, u):  # type: ignore[no-untyped-def]
    return tuple(t.new_empty(t.shape) for t in (q, k, v, a, b, gk, h0))


_fused_fwd.register_fake(_fused_fwd_fake)


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    pkg, variant, q, k, v, a, b, gk, h0, cu_seqlens, scale = inputs[:11]
    ctx.meta = (pkg, variant, scale)
    # the chunk op's third and fourth outputs: the chunk-start states and U when the forward kept them
    # (else empty)
    h, u = (output[2], output[3]) if len(output) > 2 else (None, None)
    ctx.save_for_backward(q, k, v, a, b, gk, h0, cu_seqlens, h, u)


def _grads(ctx: Any, op: str, do: torch.Tensor, dht: Optional[torch.Tensor], bwd: Any,
           **kw: Any) -> tuple[Any, ...]:
    pkg, variant, scale = ctx.meta
    q, k, v, a, b, gk, h0, cu_seqlens, h, u = ctx.saved_tensors
    return bwd(pkg, _backward_variant(op, pkg, variant), q, k, v, a, b, gk, h0, cu_seqlens, scale, do, dht, h, u,
               **kw)


def _chunk_backward(ctx: Any, do: torch.Tensor, dht: Optional[torch.Tensor], _dh: Any, _du: Any) -> tuple[Any, ...]:
    return (None, None, *_grads(ctx, "chunk", do, dht, _chunk_bwd), None, None, None, None)


def _fused_backward(ctx: Any, do: torch.Tensor, dht: Optional[torch.Tensor]) -> tuple[Any, ...]:
    return (None, None, *_grads(ctx, "fused_recurrent", do, dht, _chunk_bwd), None, None)


torch.library.register_autograd("dplr_gen::chunk_fwd", _chunk_backward, setup_context=_save_inputs)
torch.library.register_autograd("dplr_gen::fused_recurrent_fwd", _fused_backward, setup_context=_save_inputs)


# ----------------------------------------------------------------------------------------------------------
# eager mode


class _EagerOp(torch.autograd.Function):
    """The same forward and backward as the custom ops, called directly (see the note on implementations).
    One thing more: where the forward keeps the states for a backward (``disable_recompute=True``, grad mode on
    and an input that needs a gradient), it also runs the backward's prep and hands it to the first backward,
    which frees it before its token pass (chunk_driver.chunk_dplr_fwd's prep_for_bwd). The custom ops cannot:
    what autograd saves for them lives until the whole backward is done, i.e. through the token pass, the
    backward's peak."""

    @staticmethod
    def forward(ctx: Any, op: str, keep_states: bool, prep_for_bwd: bool, offsets: Optional[list[int]],
                lower_bound: Optional[float], *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.prep = []  # the forward's run of the backward's prep, if any: taken by the first backward
        ctx.offsets = offsets
        if op == "chunk":
            *out, prep = _chunk_fwd_run(*args, keep_states, prep_for_bwd, offsets, lower_bound)
            if prep is not None:
                ctx.prep.append(prep)
        else:
            out = _fused_fwd_impl(*args)
        _save_inputs(ctx, args, out)
        ctx.op = op
        return out[0], out[1]

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dht: Optional[torch.Tensor]) -> tuple[Any, ...]:
        grads = _grads(ctx, ctx.op, do, dht, _chunk_bwd_run, prep=ctx.prep, offsets=ctx.offsets)
        return (None, None, None, None, None, None, None, *grads, None, None)


# ----------------------------------------------------------------------------------------------------------
# public API


def _launching() -> bool:
    """Whether the chunk driver launches its kernels (chunk_driver.DriverOptions.launch)."""
    from . import chunk_driver

    return chunk_driver.OPTIONS.launch


def _check_keywords(chunk_size: Any, lower_bound: Any) -> None:
    if chunk_size is not None and chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64 (or None for the spec's choice), got {chunk_size!r}")
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and lower_bound < 0):
        raise ValueError(f"lower_bound must be a negative float (a promise that gk >= lower_bound) or None, got {lower_bound!r}")


def _state_pool(indices: Any, pool: Any, N: int, H: int, K: int, V: int, device: torch.device,
                grad: bool) -> torch.Tensor:
    """``ssm_state_indices`` checked against the pool ``initial_state`` [num_slots, H, K, V] (fp32, updated in
    place), as an int32 tensor on the device. Where the indices are on the host (no device sync to read them),
    every index must be a slot of the pool or negative (a padded row), and no slot may appear twice; indices on the
    device are not read: a slot >= num_slots gives that sequence NaN outputs and leaves the pool alone, and two
    sequences given one slot race (the slot ends with one of their states)."""
    if grad:
        raise ValueError("ssm_state_indices updates the state pool in place and has no gradient: call the op under "
                         "torch.no_grad() or torch.inference_mode(), or pass initial_state per sequence instead")
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise TypeError(f"ssm_state_indices must be an int32 or int64 tensor [N], got {got}")
    if tuple(indices.shape) != (N,):
        raise ValueError(f"ssm_state_indices must be [N] = [{N}] (one slot per sequence), got {tuple(indices.shape)}")
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or tuple(pool.shape[1:]) != (H, K, V):
        got = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(f"with ssm_state_indices, initial_state must be the state pool [num_slots, H, K, V] = "
                         f"[num_slots, {H}, {K}, {V}], got {got}")
    if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.device != device:
        raise ValueError(f"the state pool (initial_state) must be a contiguous float32 tensor on {device}: it is "
                         f"updated in place; got {pool.dtype} on {pool.device}, contiguous={pool.is_contiguous()}")
    if indices.device.type == "cpu":
        ids = indices.tolist()
        bad = [i for i in ids if i >= pool.shape[0]]
        if bad:
            raise ValueError(f"ssm_state_indices holds {bad[0]}, outside the pool's {pool.shape[0]} slots "
                             "(valid: 0 to num_slots - 1, or negative for a padded row)")
        used = [i for i in ids if i >= 0]
        if len(set(used)) != len(used):
            twice = sorted({i for i in used if used.count(i) > 1})
            raise ValueError(f"ssm_state_indices gives slot(s) {twice} to more than one sequence; each sequence "
                             "needs a slot of its own")
        return varlen.to_device(indices.to(torch.int32), device)
    if indices.device != device:
        raise ValueError(f"ssm_state_indices is on {indices.device} but the inputs are on {device}")
    return indices if indices.dtype == torch.int32 else indices.to(torch.int32)


def _run(
    op: str, package: "SpecPackage", names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], scale: Any,
    initial_state: Any, output_final_state: bool, cu_seqlens: Any, cu_seqlens_cpu: Any = None,
    chunk_size: int | None = None, lower_bound: float | None = None, keep_states: bool = False,
    cp_context: Any = None, state_indices: Any = None, mul_ab: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mul_ab`` (fused recurrent op): the tensors' a is RWKV-7's kk and b its rate a; the recurrence runs with
    -kk and kk * a."""
    _check_keywords(chunk_size, lower_bound)
    if cp_context is not None:  # the rank's slice of a batch split over a process group (dplr_gen/cp.py)
        # the context runs it: the runtime never imports dplr_gen.cp, the layer above it
        run_slice = getattr(cp_context, "run", None)
        if not callable(run_slice):
            raise TypeError(f"cp_context must come from dplr_gen.cp.build_cp_context, got {type(cp_context).__name__}")
        return run_slice(names, package, tensors, scale, initial_state, output_final_state, cu_seqlens,
                         cu_seqlens_cpu, chunk_size, lower_bound)
    first = tensors[0]
    if (isinstance(first, torch.Tensor) and first.is_cuda and first.device.index != torch.cuda.current_device()
            and not torch.compiler.is_compiling()):
        # kernels launch on the current device: a model split over GPUs in one process (accelerate's
        # device_map) calls with its tensors on another (the backward runs on their device's autograd thread)
        with torch.cuda.device(first.device):
            return _run(op, package, names, tensors, scale, initial_state, output_final_state, cu_seqlens,
                        cu_seqlens_cpu, chunk_size, lower_bound, keep_states, cp_context, state_indices, mul_ab)
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (*tensors, initial_state))
    if mul_ab and grad:
        # the gradient flows through the products formed here (the kernel's own form has none)
        kk, rate = tensors[3], tensors[4]
        tensors = (*tensors[:3], -kk, kk * rate, tensors[5])
        mul_ab = False
    pooled = state_indices is not None
    info = _check_inputs(names, tensors, scale, None if pooled else initial_state, cu_seqlens, cu_seqlens_cpu)
    q, k, v, a, b, g = tensors
    if pooled:
        state_indices = _state_pool(state_indices, initial_state, info["N"], info["H"], info["K"], info["V"],
                                    q.device, grad)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and _launching():
        # Triton's interpreter computes bf16 dots wrongly (off by orders of magnitude): run on float32 copies
        # and round the output to bf16; autograd rounds the gradients back to the inputs' dtypes (with every
        # launch skipped nothing is computed, and the bf16 variant's buffers are what is counted)
        o, ht = _run(op, package, names, tuple(t.float() for t in tensors), scale, initial_state,
                     output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size, lower_bound, keep_states,
                     state_indices=state_indices, mul_ab=mul_ab)
        return o.to(torch.bfloat16), ht
    variant = variant_for(package, op, q, v, g, cu_seqlens, chunk_size, lower_bound)
    var = package.variants[variant]
    # a broken promise would give finite, wrong numbers (gate_check): checked here, or (a bounded chunk variant
    # on a GPU) by its forward prep, which then gets the bound
    kernel_bound = None
    if lower_bound is not None:
        bounded = op == "chunk" and var.gate_bound is not None
        kernel_bound = gate_check.check_lower_bound(g, lower_bound, in_kernel=bounded)
    g = g.to(TORCH_DTYPES[var.gate_dtype])
    if pooled:
        h0 = initial_state
    elif initial_state is None:
        h0 = q.new_zeros(info["N"], info["H"], info["K"], info["V"], dtype=torch.float32)
    else:
        h0 = initial_state.to(torch.float32)
    cu = None if cu_seqlens is None else varlen.int32_boundaries(cu_seqlens, info["offsets"])
    args = [t.contiguous() for t in (q, k, v, a, b, g, h0)]
    # the package travels as its folder path: custom ops take plain strings, and paths are unique
    pkg = package.dir_str
    # the states are kept only for a backward to come (without one they would be written for nothing)
    keep = bool(keep_states) and op == "chunk" and grad
    if pooled or mul_ab or (not grad and not torch.compiler.is_compiling()):
        # nothing to differentiate: the implementation itself (an autograd.Function costs ~20 us of host time a
        # call, what a decode step waits for); a pool or the mul form (never with a gradient) also while
        # compiling, as the custom ops take neither
        if op == "chunk":
            o, ht = _chunk_fwd_run(pkg, variant, *args, cu, info["scale"], False, False, info["offsets"] or None,
                                   kernel_bound)[:2]
        else:
            # varlen starts read on the host (and checked: no empty sequence): as many sequences as tokens is one
            # token each, the decode step's kernel
            one_token = info["offsets"] is not None and info["N"] == info["T"]
            o, ht = _fused_fwd_impl(pkg, variant, *args, cu, info["scale"], state_indices, mul_ab, one_token)
    elif not torch.compiler.is_compiling():
        # the forward that keeps the states runs the backward's prep too (_EagerOp)
        # (the sequence starts as read on the host for the checks: the varlen slot maps are built from them)
        o, ht = _EagerOp.apply(op, keep, keep and PREP_IN_FORWARD, info["offsets"] or None, kernel_bound, pkg, variant,
                               *args, cu, info["scale"])
    elif op == "chunk":
        o, ht, _, _ = _chunk_fwd(pkg, variant, *args, cu, info["scale"], keep, kernel_bound)
    else:
        o, ht = _fused_fwd(pkg, variant, *args, cu, info["scale"])
    # with a state pool the final states are in the pool (returned as the final state)
    return o, (ht if output_final_state or pooled else None)


def chunk_dplr_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, gk: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, *, package: "SpecPackage", chunk_size: int | None = None,
    safe_gate: bool = False, lower_bound: float | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
    disable_recompute: bool = False, cp_context: Any = None, **unexpected: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked DPLR delta rule. ``lower_bound`` promises gk >= lower_bound and selects a faster variant built
    for a bound at or below it; ``chunk_size`` prefers a variant of that chunk where one is built and is
    otherwise ignored (chunking is an implementation detail: results differ only by rounding; a variant
    generated on demand takes the spec's usual chunk); a call no built variant covers (any K, V from 16 to 256)
    gets its variant generated on demand from the package's spec (dplr_gen.runtime.ondemand: rendered, compiled once
    into the cache, one log line naming the spec entry that would ship it; DPLR_GEN_NO_JIT=1 makes that an
    error); bf16 on CPU tensors (Triton's interpreter, whose bf16 dots are wrong) computes in float32 and
    rounds the output to bf16; ``disable_recompute=True`` keeps the chunk-start states and U of the forward for the backward
    instead of recomputing them ([T/C, H, K, V] per sequence: faster backward, more memory; same result), and in
    eager mode the backward's prep too (~5 [B, T, H, K] tensors more until the backward); only where a backward
    can follow (grad mode on, an input that requires grad): otherwise it changes nothing;
    ``safe_gate`` (fla's promise that gk >= -5) is accepted for fla compatibility and changes nothing (pass
    ``lower_bound`` to select a bounded variant). The ``lower_bound`` promise is checked (on a GPU
    without a host sync, inside the bounded variant's prep: see dplr_gen.runtime.gate_check; DPLR_GEN_CHECK_LOWER_BOUND=0
    skips it).
    ``initial_state`` may be float32 or a lower precision (bf16, fp16): the state is computed and returned in
    float32 either way, and its gradient comes back in initial_state's dtype. ``cp_context`` (from
    dplr_gen.cp.build_cp_context): the inputs are this rank's slice of a packed batch split over a process group
    (context parallelism; see dplr_gen/cp.py for what each rank returns; ``disable_recompute`` changes nothing
    there)."""
    if unexpected:
        raise TypeError(f"chunk_dplr_delta_rule got unexpected keyword argument(s) {sorted(unexpected)}")
    return _run("chunk", package, ("q", "k", "v", "a", "b", "gk"), (q, k, v, a, b, gk), scale, initial_state,
                output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size, lower_bound, disable_recompute, cp_context)


def chunk_rwkv7(
    r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    scale: float = 1.0, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, *, package: "SpecPackage", chunk_size: int | None = None,
    safe_gate: bool = False, lower_bound: float | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
    disable_recompute: bool = False, cp_context: Any = None, **unexpected: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RWKV-7 (r, w, k, v, a, b) over the same recurrence: q = r, gk = w (keywords as chunk_dplr_delta_rule)."""
    if unexpected:
        raise TypeError(f"chunk_rwkv7 got unexpected keyword argument(s) {sorted(unexpected)}")
    return _run("chunk", package, ("r", "k", "v", "a", "b", "w"), (r, k, v, a, b, w), scale, initial_state,
                output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size, lower_bound, disable_recompute, cp_context)


def _check_reverse(op: str, reverse: Any) -> None:
    if reverse:
        raise ValueError(f"{op}: reverse=True (the sequence walked backwards) is not supported; pass reverse=False")


def fused_recurrent_dplr_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, gk: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, *, package: "SpecPackage", reverse: bool = False,
    ssm_state_indices: torch.Tensor | None = None, **unexpected: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step-by-step DPLR delta rule for decoding (small T); exact for any gate. ``ssm_state_indices`` [N] (for
    serving): ``initial_state`` is a pool of states [num_slots, H, K, V] (float32); sequence i starts from slot
    ssm_state_indices[i] and its final state is written back there, in place (the pool is returned as the final
    state); a negative index is a padded row (zero initial state, nothing written). Indices on the host are
    checked (in range, no slot twice); indices on the device are not read (a slot past the pool gives NaN
    outputs and writes nothing). No gradient."""
    if unexpected:
        raise TypeError(f"fused_recurrent_dplr_delta_rule got unexpected keyword argument(s) {sorted(unexpected)}")
    _check_reverse("fused_recurrent_dplr_delta_rule", reverse)
    return _run("fused_recurrent", package, ("q", "k", "v", "a", "b", "gk"), (q, k, v, a, b, gk), scale,
                initial_state, output_final_state, cu_seqlens, state_indices=ssm_state_indices)


def fused_recurrent_rwkv7(
    r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    scale: float = 1.0, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, *, package: "SpecPackage", reverse: bool = False,
    ssm_state_indices: torch.Tensor | None = None, **unexpected: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RWKV-7 argument order over the fused recurrent op (``ssm_state_indices``: see
    fused_recurrent_dplr_delta_rule)."""
    if unexpected:
        raise TypeError(f"fused_recurrent_rwkv7 got unexpected keyword argument(s) {sorted(unexpected)}")
    _check_reverse("fused_recurrent_rwkv7", reverse)
    return _run("fused_recurrent", package, ("r", "k", "v", "a", "b", "w"), (r, k, v, a, b, w), scale,
                initial_state, output_final_state, cu_seqlens, state_indices=ssm_state_indices)


def fused_mul_recurrent_rwkv7(
    r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kk: torch.Tensor, a: torch.Tensor,
    scale: float = 1.0, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, *, package: "SpecPackage", reverse: bool = False,
    ssm_state_indices: torch.Tensor | None = None, **unexpected: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RWKV-7's decoding form, as fla-core's layer calls it: kk (the normalised key) and the in-context rate a,
    the recurrence running with a_t = -kk_t and b_t = kk_t * a_t, formed inside the kernel (no gradient needed)
    or before it (``ssm_state_indices``: see fused_recurrent_dplr_delta_rule)."""
    if unexpected:
        raise TypeError(f"fused_mul_recurrent_rwkv7 got unexpected keyword argument(s) {sorted(unexpected)}")
    _check_reverse("fused_mul_recurrent_rwkv7", reverse)
    return _run("fused_recurrent", package, ("r", "k", "v", "kk", "a", "w"), (r, k, v, kk, a, w), scale,
                initial_state, output_final_state, cu_seqlens, state_indices=ssm_state_indices, mul_ab=True)

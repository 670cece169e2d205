"""Sequence boundaries (``cu_seqlens``) as the chunk kernels need them, read and converted once per value.

A model passes the same ``cu_seqlens`` to every layer, and its backward passes it again; a data loader makes a
new tensor each step, often int64 (fla-core's type hint). What the kernels need from it: the boundaries as an
int32 device tensor, and per chunk size a slot map (which sequence and chunk each chunk slot holds). Both are
kept per process, keyed by the *values* of the boundaries, so that a new tensor with known values, an int64
tensor or an int32 one, the forward or the backward, finds them built; and the values of a tensor already seen
(same object, not modified in place since) are found by its identity, without reading it from the device again.

Reading the values of a CUDA tensor waits for the device (``tolist``): it happens once per tensor object, the
first time a call sees it. The maps are built on the host from the values and copied to the device from pinned
memory without waiting. While torch.compile traces or a CUDA graph is captured nothing is read or cached: the
int32 copy and the maps are computed on the device from the tensor itself, so that a replay reads its values
then.
"""

from __future__ import annotations

import collections
import threading
import weakref
from array import array
from typing import Any

import torch

from .devices import cuda_index

# values of the boundaries -> their device forms; identity of a tensor -> its values (the last few of each)
_KEPT = 32
_LOCK = threading.Lock()  # calls from several threads (one per device, say) share the caches
_BY_VALUE: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
_BY_OBJECT: "collections.OrderedDict[int, tuple[weakref.ref, int, tuple[int, ...]]]" = collections.OrderedDict()


def _remember(cache: collections.OrderedDict, key: Any, value: Any) -> Any:
    with _LOCK:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _KEPT:
            cache.popitem(last=False)
    return value


def _lookup(cache: collections.OrderedDict, key: Any) -> Any:
    with _LOCK:
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
        return hit


def tracing(t: torch.Tensor) -> bool:
    """Whether values cannot be read now: torch.compile is tracing, or a CUDA graph is being captured."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_offsets(offsets: tuple[int, ...], T: int) -> None:
    """The boundaries of sequences laid end to end over T tokens: 0, increasing, T (ValueError naming
    cu_seqlens otherwise)."""
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
    if any(y < x for x, y in zip(offsets, offsets[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T}, got {offsets[-1]}")
    if any(y == x for x, y in zip(offsets, offsets[1:])):
        raise ValueError("cu_seqlens holds an empty sequence (two equal entries); every sequence needs a token")


def read_offsets(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, T: int) -> tuple[int, ...] | None:
    """The boundaries as host integers, checked against T; None where they cannot be read now (``tracing``).
    From ``cu_seqlens_cpu`` where given (no wait), else from the tensor: found by identity where this tensor was
    read before and not modified in place since, else read (a CUDA tensor: waits for the device)."""
    if tracing(cu_seqlens):
        return None
    if isinstance(cu_seqlens_cpu, torch.Tensor):
        offsets = tuple(int(x) for x in cu_seqlens_cpu.tolist())
        if len(offsets) != cu_seqlens.numel():
            raise ValueError(f"cu_seqlens_cpu has {len(offsets)} entries but cu_seqlens {cu_seqlens.numel()}")
        check_offsets(offsets, T)
        return offsets
    hit = _lookup(_BY_OBJECT, id(cu_seqlens))
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version and hit[2][-1] == T:
        return hit[2]
    offsets = tuple(int(x) for x in cu_seqlens.tolist())
    check_offsets(offsets, T)
    return _remember(_BY_OBJECT, id(cu_seqlens), (weakref.ref(cu_seqlens), cu_seqlens._version, offsets))[2]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: from pinned memory without waiting for the device's queued work (a copy
    from pageable memory would wait for it)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _stream_key(device: torch.device) -> Any:
    # the raw handle of the current stream: torch.cuda.current_stream(device) costs ~10x more host time
    if device.type != "cuda":
        return None
    return torch._C._cuda_getCurrentRawStream(cuda_index(device))


def int32_boundaries(cu_seqlens: torch.Tensor, offsets: tuple[int, ...] | None) -> torch.Tensor:
    """cu_seqlens as a contiguous int32 tensor on its device: the tensor itself where it is one; else one copy
    per value (``offsets``), or a conversion on the device where the values were not read."""
    if cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous():
        return cu_seqlens
    if offsets is None:
        return cu_seqlens.to(torch.int32).contiguous()
    key = ("cu32", offsets, cu_seqlens.device, _stream_key(cu_seqlens.device))
    hit = _lookup(_BY_VALUE, key)
    if hit is None:
        hit = _remember(_BY_VALUE, key, to_device(torch.tensor(offsets, dtype=torch.int32), cu_seqlens.device))
    return hit


def chunk_map_from_cu_seqlens(cu_seqlens: torch.Tensor, C: int, n_slots: int) -> torch.Tensor:
    """int32 [n_slots, 2]: (sequence, chunk index within it) per slot; chunk index -1 marks an unused slot
    (the chunk starting at token s of sequence n owns slot s // C + n). Built where ``cu_seqlens`` lives, with
    a searchsorted over the first slot of each sequence: O(n_slots log N) work, no read of its values."""
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    first = cu[:-1] // C + torch.arange(N, device=cu.device)  # first slot of each sequence, increasing
    nch = (cu[1:] - cu[:-1] + C - 1) // C
    slots = torch.arange(n_slots, device=cu.device)
    n = (torch.searchsorted(first, slots, right=True) - 1).clamp_(0, N - 1)
    i_t = slots - first[n]
    i_t = torch.where((i_t >= 0) & (i_t < nch[n]), i_t, torch.full_like(i_t, -1))
    return torch.stack([n, i_t], 1).to(torch.int32).contiguous()


# Below this many sequences the host lays a map out sequence by sequence (a few array copies each), above it by the
# torch ops of chunk_map_from_cu_seqlens, whose cost hardly grows with the sequences. Development CPU, new
# boundaries each call: 11-18 us against 50-94 us for 8 to 11 sequences, 36-38 against 46-54 at 64, 129-144
# against 65 at 300 (docs/design.md, varlen).
HOST_MAP_MAX_SEQS = 64
_COUNTING = array("i")  # 0, 1, 2, ...: grown as a sequence needs more chunks


def host_chunk_map(offsets: tuple[int, ...] | list[int], C: int, n_slots: int) -> torch.Tensor:
    """chunk_map_from_cu_seqlens of host boundaries ``offsets``, on the host (the same tensor)."""
    N = len(offsets) - 1
    if N <= HOST_MAP_MAX_SEQS:
        firsts = [bos // C + n for n, bos in enumerate(offsets[:-1])] + [n_slots]
        seqs, chunks = array("i"), array("i")
        for n in range(N):
            k = (offsets[n + 1] - offsets[n] + C - 1) // C
            span = firsts[n + 1] - firsts[n]  # the sequence's slots: its chunks, then at most one unused
            if span < k:  # (never for the drivers' n_slots; the torch ops say what such a map holds)
                break
            if len(_COUNTING) < k:
                with _LOCK:  # (grown by one thread at a time: each extends from the length it sees)
                    _COUNTING.extend(range(len(_COUNTING), 2 * k))
            seqs.extend(array("i", (n,)) * span)
            chunks.extend(_COUNTING[:k])
            chunks.extend(array("i", (-1,)) * (span - k))
        else:
            return torch.stack((torch.frombuffer(seqs, dtype=torch.int32),
                                torch.frombuffer(chunks, dtype=torch.int32)), 1)
    return chunk_map_from_cu_seqlens(torch.tensor(offsets, dtype=torch.int64), C, n_slots)


def slot_map(cu_seqlens: torch.Tensor, C: int, n_slots: int, offsets: tuple[int, ...] | list[int] | None = None,
             ) -> torch.Tensor:
    """chunk_map_from_cu_seqlens(cu_seqlens, C, n_slots) on cu_seqlens' device. With the values read on the host
    (``offsets``): built there once per value, chunk size and stream and kept (every layer and the backward
    reuse it). Without them (tracing, or a caller that did not read them): built on the device each call."""
    if offsets is None or tracing(cu_seqlens):
        return chunk_map_from_cu_seqlens(cu_seqlens, C, n_slots)
    offsets = tuple(offsets)
    key = ("map", offsets, C, n_slots, cu_seqlens.device, _stream_key(cu_seqlens.device))
    hit = _lookup(_BY_VALUE, key)
    if hit is None:
        hit = _remember(_BY_VALUE, key, to_device(host_chunk_map(offsets, C, n_slots), cu_seqlens.device))
    return hit


def clear() -> None:
    """Forget every kept value (tests)."""
    with _LOCK:
        _BY_VALUE.clear()
        _BY_OBJECT.clear()

"""Context parallelism (dplr_gen/cp.py) on CPU: gloo groups of spawned processes, fp32 under the interpreter. Each rank
runs the op on its slice of a packed batch; the slices' outputs, final states and every gradient must equal the
single-process op on the whole batch within 1e-5 (relative norm), NaN-poisoned buffers throughout."""

from __future__ import annotations

import dataclasses
import datetime
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dplr_gen.runtime import chunk_driver, gate_check, ops
from dplr_gen.cp import build_cp_context
from dplr_gen.runtime.loader import package_at
from dplr_gen.testing import rel_err, rwkv7_inputs

from .helpers import render_package

SPEC = """
name: cp_test
targets: [sm_80]
variants:
  - ops: [chunk]
    dtypes: [fp32, fp16]
    head_dims: [16]
    chunk_sizes: [16]
    varlen: [false, true]
    gate_bounds: [null, -0.61]
variant_tuning:
  - when: {op: [chunk], varlen: [false]}
    tuning:
      chunk.fwd_small: {segments: 4}
      chunk.bwd_dh_small: {segments: 4}
"""
NAMES = ("q", "k", "v", "a", "b", "gk")


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "cp_test")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    # a bounded wait: a rank that fails after the call checks (a bug) makes the others' collectives time out with
    # an error instead of hanging the test
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))


def _call(pkg: Any, x: dict[str, torch.Tensor], rwkv: bool, scale: float, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if rwkv:  # RWKV-7 argument order: r, w, k, v, a, b
        return ops.chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"], scale=scale,
                               output_final_state=True, package=pkg, **kw)
    return ops.chunk_dplr_delta_rule(**{n: x[n] for n in NAMES}, scale=scale, output_final_state=True, package=pkg,
                                     **kw)


def _worker(rank: int, world: int, port: int, pkg_dir: str, work: str, segments: int | None, rwkv: bool,
            mode: str) -> None:
    """One rank: its slice of the inputs saved by the parent, forward and backward under a context, results saved."""
    torch.set_num_threads(1)
    out = Path(work) / f"rank{rank}.pt"
    try:
        _init(rank, world, port)
        chunk_driver.OPTIONS = chunk_driver.DriverOptions(poison=True, segments=segments)
        data = torch.load(Path(work) / "inputs.pt")
        cu = data["cu"]
        ctx = build_cp_context(cu, cu_seqlens_cpu=cu if rank % 2 else None)
        T = ctx.T_local
        x = {n: data[n][:, rank * T:(rank + 1) * T].clone().requires_grad_(True) for n in NAMES}
        h0 = data["h0"].clone().requires_grad_(True)
        if mode == "disagree" and rank == 1:  # a head size the other ranks do not use
            x = {n: torch.cat([t.detach(), t.detach()], -1) for n, t in x.items()}
            h0 = None
        if mode == "refused" and rank == 1:  # an initial state of the wrong size
            h0 = h0[:, :, :8]
        kw: dict[str, Any] = {}
        promises: list[Any] = []
        if mode == "broken_promise":  # rank 1 holds a gate below the bound every rank promises
            kw["lower_bound"] = -0.5
            if rank == 1:
                x["gk"] = x["gk"].detach().clone()
                x["gk"][0, 3, 0, 5] = -0.9
                x["gk"].requires_grad_(True)
        if mode == "kernel_check":  # the GPU's form: the bounded variants' preps check the promise
            gate_check.KERNEL_ON_CPU = True
            kw["lower_bound"] = -0.61
            real = chunk_driver.chunk_prep
            chunk_driver.chunk_prep = lambda *a, **k: promises.append(
                (bool(k.get("for_bwd")), getattr(k.get("promise"), "lower_bound", None))) or real(*a, **k)
        o, ht = _call(package_at(pkg_dir), x, rwkv, data["scale"], initial_state=h0, cp_context=ctx, **kw)
        torch.autograd.backward((o, ht), (data["do"][:, rank * T:(rank + 1) * T], data["dht"]))
        torch.save({"o": o.detach(), "ht": ht.detach(), "dh0": h0.grad, **{n: x[n].grad for n in NAMES},
                    "promises": promises}, out)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts on it
        torch.save({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, out)
    finally:
        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while another still uses them
            dist.destroy_process_group()


def _inputs(offsets: list[int], H: int, K: int, seed: int) -> dict[str, Any]:
    T = offsets[-1]
    # slow decays (gk > -0.05): a slice's map P stays far from 0 over 40 tokens, so a wrong exchange shows
    x = rwkv7_inputs(1, T, H, K, seed=seed, initial_state=False, gate_bound=-0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    N = len(offsets) - 1
    return {
        **{n: x[n] for n in NAMES},
        "cu": torch.tensor(offsets, dtype=torch.int64),
        "h0": torch.randn(N, H, K, K, generator=gen) * 0.5,
        "do": torch.randn(1, T, H, K, generator=gen),
        "dht": torch.randn(N, H, K, K, generator=gen),
        "scale": 0.7,
    }


def _spawn(tmp_path: Path, pkg: Any, world: int, data: dict[str, Any], segments: int | None = None,
           rwkv: bool = False, mode: str = "") -> list[dict[str, Any]]:
    torch.save(data, tmp_path / "inputs.pt")
    # a rank process that dies (not one that reports an error: those are results) is started again once, on a
    # fresh port: the free port can be taken by another test process before the group binds it, and gloo can
    # abort while tearing down a group whose peer already left
    for attempt in (0, 1):
        for r in range(world):
            (tmp_path / f"rank{r}.pt").unlink(missing_ok=True)
        try:
            mp.spawn(_worker, args=(world, _free_port(), str(pkg.dir), str(tmp_path), segments, rwkv, mode),
                     nprocs=world, join=True)
            break
        except mp.ProcessExitedException:
            if attempt:
                raise
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _single(pkg: Any, data: dict[str, Any], rwkv: bool) -> dict[str, torch.Tensor]:
    """The single-process op on the whole batch: o, final states and every gradient."""
    x = {n: data[n].clone().requires_grad_(True) for n in NAMES}
    h0 = data["h0"].clone().requires_grad_(True)
    cu = data["cu"] if data["cu"].numel() > 2 else None
    o, ht = _call(pkg, x, rwkv, data["scale"], initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu)
    torch.autograd.backward((o, ht), (data["do"], data["dht"]))
    return {"o": o.detach(), "ht": ht.detach(), "dh0": h0.grad, **{n: x[n].grad for n in NAMES}}


def _gather(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The ranks' results as the whole batch's."""
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res.get('trace')}"
    return {
        "o": torch.cat([res["o"] for res in results], 1),
        # each sequence's final state comes from the rank where it ends, zeros from the others: their sum is all
        "ht": sum(res["ht"] for res in results),
        # each rank's initial-state gradient holds the sequences that start there: their sum is the total
        "dh0": sum(res["dh0"] for res in results),
        **{n: torch.cat([res[n] for res in results], 1) for n in NAMES},
    }


def _check(results: list[dict[str, Any]], ref: dict[str, torch.Tensor]) -> None:
    got = _gather(results)
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    assert all(e <= 1e-5 for e in errs.values()), errs


# (world, offsets, T_local): every sequence layout the exchange distinguishes
CASES = {
    # one sequence over both ranks: rank 0's starts there and leaves, rank 1's enters and ends there
    "dense-2": (2, [0, 80]),
    # several sequences inside ranks; a 2-token sequence with one token on each side of the boundary (the piece
    # leaving and the piece entering are 1 token); a 1-token sequence right after the boundary
    "varlen-2": (2, [0, 5, 31, 33, 34, 64]),
    # one sequence over all four ranks: ranks 1 and 2 are spanned (their maps fold through)
    "dense-4": (4, [0, 160]),
    # a sequence across all ranks, starting mid-way on rank 0 and ending mid-way on rank 3
    "across-all-4": (4, [0, 5, 93, 96]),
    # sequences ending exactly at boundaries, a 1-token sequence at a boundary, crossings from mid-slice
    "varlen-4": (4, [0, 3, 30, 48, 49, 90, 96]),
}


@pytest.mark.parametrize("case, segments, rwkv", [
    ("dense-2", None, False),  # one segment: rank 0 walks to its final state, rank 1's reverse pass gives dS
    ("dense-2", 3, True),      # 3 segments: the maps, every segment's gradient map on rank 1 included
    ("varlen-2", None, True),
], ids=["dense-2", "dense-2-seg3-rwkv7", "varlen-2-rwkv7"])
def test_two_ranks(pkg, tmp_path: Path, case: str, segments: int | None, rwkv: bool) -> None:
    world, offsets = CASES[case]
    data = _inputs(offsets, 2, 16, seed=len(offsets) + world)
    _check(_spawn(tmp_path, pkg, world, data, segments, rwkv), _single(pkg, data, rwkv))


def test_two_ranks_delta_rule_masked_gates(pkg, tmp_path: Path) -> None:
    """Delta-rule inputs (b = -a, whose chunks take the substitution inverse) with half the gates exactly 0 (no
    decay: P keeps its full size across the slice), over 3 segments."""
    world, offsets = CASES["dense-2"]
    data = _inputs(offsets, 2, 16, seed=11)
    data["b"] = -data["a"]
    gen = torch.Generator().manual_seed(12)
    data["gk"] = torch.where(torch.rand(data["gk"].shape, generator=gen) < 0.5, 0.0, data["gk"])
    _check(_spawn(tmp_path, pkg, world, data, 3), _single(pkg, data, False))


def test_two_ranks_fp16(pkg, tmp_path: Path) -> None:
    """fp16 inputs (the interpreter computes in fp16) over 3 segments: every output and gradient of the 2-rank op
    is as close to the fp32 single-process op as the fp16 single-process op is (within 10%, + 1e-4)."""
    world, offsets = CASES["dense-2"]
    data = _inputs(offsets, 2, 16, seed=13)
    ref = _single(pkg, data, True)
    half = {**data, **{n: data[n].half() for n in (*NAMES, "do")}}
    one = _single(pkg, half, True)
    got = _gather(_spawn(tmp_path, pkg, world, half, 3, True))
    errs = {n: (rel_err(got[n].float(), ref[n]), rel_err(one[n].float(), ref[n])) for n in ref}
    assert all(cp <= 1.1 * single + 1e-4 for cp, single in errs.values()), errs
    assert got["o"].dtype == torch.float16 and all(e[1] > 1e-5 for e in errs.values()), errs  # fp16 arithmetic ran


@pytest.mark.slow
@pytest.mark.parametrize("case, segments", [
    ("dense-4", 3),          # 40-token slices of 3 chunks: the spanned slices' maps over 3 segments
    ("across-all-4", None),  # one segment: the map from one walk
    ("varlen-4", None),
], ids=["dense-4-seg3", "across-all-4", "varlen-4"])
def test_four_ranks(pkg, tmp_path: Path, case: str, segments: int | None) -> None:
    world, offsets = CASES[case]
    data = _inputs(offsets, 1, 16, seed=len(offsets) + world)
    _check(_spawn(tmp_path, pkg, world, data, segments), _single(pkg, data, False))


def test_ranks_disagreeing_or_refusing(pkg, tmp_path: Path) -> None:
    """Ranks whose calls disagree (head size) all fail with the disagreement; a rank whose arguments are refused
    fails with its own error and the others name it (none waits for the exchange)."""
    data = _inputs([0, 64], 1, 16, seed=3)
    for res in _spawn(tmp_path, pkg, 2, data, mode="disagree"):
        assert "the ranks disagree on K: [16, 32]" in res.get("error", ""), res
    rank0, rank1 = _spawn(tmp_path, pkg, 2, data, mode="refused")
    assert "initial_state must be [N_global, H, K, V] = (1, 1, 16, 16)" in rank1.get("error", ""), rank1
    assert "rank(s) [1] of the group refused their arguments" in rank0.get("error", ""), rank0


def test_lower_bound_promise(pkg, tmp_path: Path) -> None:
    """lower_bound under CP. Checked on the host (CPU tensors): a rank whose gates break the promise fails with the
    error naming it and the other ranks name that rank (none waits for the exchange). In the GPU's form (the
    bounded variants' forward preps check it, no pass of its own): every forward prep of every rank gets the
    promise and the results are the unbounded single-process op's."""
    world, offsets = CASES["varlen-2"]  # the sequences inside rank 0, the crossing pieces, rank 1's last ones
    data = _inputs(offsets, 2, 16, seed=21)
    rank0, rank1 = _spawn(tmp_path, pkg, world, data, mode="broken_promise")
    assert "lower_bound=-0.5 promises gk >= -0.5 everywhere, but min(gk) = -0.9" in rank1.get("error", ""), rank1
    assert "rank(s) [1] of the group refused their arguments" in rank0.get("error", ""), rank0
    results = _spawn(tmp_path, pkg, world, data, mode="kernel_check")
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res.get('trace')}"
        fwd = [bound for bwd, bound in res["promises"] if not bwd]
        assert fwd and all(bound == -0.61 for bound in fwd), (r, res["promises"])
    _check(results, _single(pkg, data, False))


def test_dense_variant_without_maps_is_refused(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """A sequence crossing a boundary needs the dense variant's segment-map kernels: where the spec gave it none,
    every rank refuses the call naming the variant and the tuning that builds them (none waits)."""
    bare = render_package(tmp_path_factory.mktemp("gen"),
                          SPEC.split("variant_tuning:")[0].replace("name: cp_test", "name: cp_bare"), "cp_bare")
    data = _inputs([0, 64], 1, 16, seed=4)
    for res in _spawn(tmp_path, bare, 2, data):
        assert "needs the segment-map kernels of dense variant chunk_fp32_k16" in res.get("error", ""), res
        assert "chunk.fwd_small: {segments: N}" in res["error"], res


# ----------------------------------------------------------------------------------------------------------------
# one process: a group of one, and bad input


@pytest.fixture
def group_of_one():
    _init(0, 1, _free_port())
    yield
    dist.destroy_process_group()


def test_group_of_one_runs_the_plain_op(pkg, group_of_one) -> None:
    data = _inputs([0, 7, 40], 2, 16, seed=5)
    ref = _single(pkg, data, False)
    x = {n: data[n].clone().requires_grad_(True) for n in NAMES}
    h0 = data["h0"].clone().requires_grad_(True)
    o, ht = _call(pkg, x, False, data["scale"], initial_state=h0, cp_context=build_cp_context(data["cu"]))
    torch.autograd.backward((o, ht), (data["do"], data["dht"]))
    got = {"o": o, "ht": ht, "dh0": h0.grad, **{n: x[n].grad for n in NAMES}}
    assert all(rel_err(got[n], ref[n]) <= 1e-6 for n in ref)


def test_bad_input(pkg, group_of_one) -> None:
    data = _inputs([0, 7, 40], 1, 16, seed=6)
    x = {n: data[n] for n in NAMES}
    ctx = build_cp_context(data["cu"])
    with pytest.raises(ValueError, match="cu_seqlens must be strictly increasing"):
        build_cp_context(torch.tensor([0, 7, 7, 40]))
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32 or int64"):
        build_cp_context(torch.tensor([0.0, 40.0]))
    # fla-core's positional order (cu_seqlens, group, conv1d_kernel_size, cu_seqlens_cpu) builds the same context
    fla_order = build_cp_context(data["cu"], None, 4, data["cu"].clone())
    assert (fla_order.offsets, fla_order.key) == (ctx.offsets, ctx.key)
    with pytest.raises(TypeError, match="pass cu_seqlens_cpu by keyword"):
        build_cp_context(data["cu"], None, data["cu"])
    with pytest.raises(TypeError, match="conv1d_kernel_size must be None or a positive int, got int"):
        build_cp_context(data["cu"], None, 0)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        build_cp_context(data["cu"], conv1d_size=4)
    with pytest.raises(ValueError, match=r"T_global = 40 must be world_size \(1\) x T_local, but q has T_local = 39"):
        _call(pkg, {n: t[:, :39] for n, t in x.items()}, False, 1.0, cp_context=ctx)
    with pytest.raises(ValueError, match="must be \\[1, T_local, H, K\\], got B = 2"):
        _call(pkg, {n: t.expand(2, -1, -1, -1) for n, t in x.items()}, False, 1.0, cp_context=ctx)
    with pytest.raises(ValueError, match="cu_seqlens: under cp_context"):
        _call(pkg, x, False, 1.0, cp_context=ctx, cu_seqlens=torch.tensor([0, 40]))
    with pytest.raises(ValueError, match=r"initial_state must be \[N_global, H, K, V\] = \(2, 1, 16, 16\)"):
        _call(pkg, x, False, 1.0, cp_context=ctx, initial_state=data["h0"][:1])
    with pytest.raises(TypeError, match="cp_context must come from dplr_gen.cp.build_cp_context"):
        _call(pkg, x, False, 1.0, cp_context=object())
    with pytest.raises(ValueError, match="built for rank 1 of its group, but this process is rank 0 there"):
        _call(pkg, x, False, 1.0, cp_context=dataclasses.replace(ctx, rank=1))


def test_total_not_a_multiple_of_the_world(tmp_path: Path) -> None:
    """A 2-process group and 41 tokens: the context refuses (each rank would hold 20.5)."""
    mp.spawn(_build_odd, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        assert "T_global = 41 is not a multiple of the group's world_size = 2" in (tmp_path / f"{r}.txt").read_text()


def _build_odd(rank: int, port: int, work: str) -> None:
    _init(rank, 2, port)
    try:
        build_cp_context(torch.tensor([0, 41]))
        msg = "built"
    except ValueError as e:
        msg = str(e)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    (Path(work) / f"{rank}.txt").write_text(msg)



def test_descriptors_go_over_a_host_group(group_of_one, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose backend takes no host tensors (NCCL) gets a gloo twin over its ranks, made once and reused;
    a gloo group is its own."""
    from dplr_gen import cp

    world = dist.group.WORLD
    assert cp._host_group(world) is world
    monkeypatch.setattr(cp.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(cp, "_HOST_GROUPS", {})
    twin = cp._host_group(world)
    assert twin is not world and cp._host_group(world) is twin
    assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(world)
    out = [torch.empty(3, dtype=torch.int64)]
    dist.all_gather(out, torch.arange(3), group=twin)
    assert out[0].tolist() == [0, 1, 2]
